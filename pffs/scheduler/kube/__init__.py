"""The Kubernetes edge of the scheduler: plain Kubernetes JSON in, the core's objects out, and back.

Reading objects: ``json_fields.py`` (checked access, ``BadObject``), ``quantity.py`` (resource quantities),
``names.py`` (every label and annotation read or written), ``locality.py`` (the cache report a node's pffs
publishes and the datasets a pod reads; the CSI plugin writes what it reads), ``nodes.py``, ``pods.py``,
``taints.py``, ``groups.py`` (gangs), ``snapshot.py`` (one cycle's view). Acting: ``api_client.py`` (a small
REST client), ``actions.py`` (bind, evict, say why a pod waits). Serving: ``loop.py`` (`pffs scheduler`),
``extender.py`` (`pffs extender`), ``queues_config.py`` (``--queues FILE``), ``prometheus.py`` (/metrics)."""
