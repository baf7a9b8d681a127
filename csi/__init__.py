"""pffs.csi: the Kubernetes CSI plugin (Identity, Controller and Node servicers). Built in its own issue."""
