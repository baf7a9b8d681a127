{{/* The CSI driver's name: the CSIDriver object, the plugin's socket folder, StorageClasses' provisioner. */}}
{{- define "pffs-csi.driver" -}}
csi.pffs.io
{{- end -}}

{{/* The pffs image, REGISTRY/REPOSITORY:TAG (the tag defaults to the chart's appVersion). */}}
{{- define "pffs-csi.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if eq (toString $tag) "latest" -}}
{{- fail "image.tag: name a version, not latest" -}}
{{- end -}}
{{- if .Values.image.registry -}}
{{ trimSuffix "/" .Values.image.registry }}/{{ .Values.image.repository }}:{{ $tag }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{/* The kubelet's root dir, without a trailing slash. */}}
{{- define "pffs-csi.kubeletPath" -}}
{{- $path := trimSuffix "/" .Values.node.kubeletPath -}}
{{- if not (hasPrefix "/" $path) -}}
{{- fail (printf "node.kubeletPath %q: an absolute path" .Values.node.kubeletPath) -}}
{{- end -}}
{{ $path }}
{{- end -}}

{{/* The plugin's CSI socket, where the kubelet dials it (the kubelet dir is at the same path inside). */}}
{{- define "pffs-csi.socketDir" -}}
{{ include "pffs-csi.kubeletPath" . }}/plugins/{{ include "pffs-csi.driver" . }}
{{- end -}}

{{/* The node state dir inside the containers (its host path is node.stateDir). */}}
{{- define "pffs-csi.stateDir" -}}
/var/lib/pffs-csi
{{- end -}}

{{/* The disk cache's path, the same inside the containers as on the host. */}}
{{- define "pffs-csi.cacheDir" -}}
{{- if .Values.node.cacheDir -}}
{{ trimSuffix "/" .Values.node.cacheDir }}
{{- else -}}
{{ include "pffs-csi.stateDir" . }}/cache
{{- end -}}
{{- end -}}

{{/* The mounter's socket, in the state dir both DaemonSets mount. */}}
{{- define "pffs-csi.mounterSocket" -}}
{{ include "pffs-csi.stateDir" . }}/mounter.sock
{{- end -}}

{{/* Logging flags of a pffs container, as YAML list items (empty for logLevel 0 and text). */}}
{{- define "pffs-csi.logArgs" -}}
{{- $level := int .Values.logLevel -}}
{{- if or (lt $level 0) (gt $level 2) -}}
{{- fail (printf "logLevel %v: 0, 1 or 2" .Values.logLevel) -}}
{{- end -}}
{{- if not (has .Values.logFormat (list "text" "json")) -}}
{{- fail (printf "logFormat %q: text or json" .Values.logFormat) -}}
{{- end -}}
{{- $args := list -}}
{{- if eq $level 1 -}}{{- $args = append $args "-v" -}}{{- end -}}
{{- if eq $level 2 -}}{{- $args = append $args "-vv" -}}{{- end -}}
{{- if eq .Values.logFormat "json" -}}{{- $args = concat $args (list "--log-format" "json") -}}{{- end -}}
{{- with $args -}}{{- toYaml . -}}{{- end -}}
{{- end -}}

{{/* Labels of every object of a component (pass a dict: root, component). */}}
{{- define "pffs-csi.labels" -}}
{{ include "pffs-csi.selectorLabels" . }}
app.kubernetes.io/part-of: pffs
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The selector of a component's pods: the name only, as the kustomize manifests before the chart had it
(a workload's selector cannot change, so `kubectl apply` over an older install keeps working). */}}
{{- define "pffs-csi.selectorLabels" -}}
app.kubernetes.io/name: pffs-csi-{{ .component }}
{{- end -}}

{{/* Pod-level networking. */}}
{{- define "pffs-csi.network" -}}
hostNetwork: {{ .Values.hostNetwork }}
dnsPolicy: {{ ternary "ClusterFirstWithHostNet" "ClusterFirst" .Values.hostNetwork }}
{{- end -}}

{{/* Scrape annotations of a pod serving /metrics on `port` (pass a dict: root, port). */}}
{{- define "pffs-csi.scrapeAnnotations" -}}
{{- if .root.Values.metrics.enabled -}}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ .port | quote }}
  prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{/* imagePullSecrets of a pod spec. */}}
{{- define "pffs-csi.pullSecrets" -}}
{{- with .Values.imagePullSecrets -}}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The cache group's token, where the plugin and the mounter both read it. */}}
{{- define "pffs-csi.cacheGroupTokenDir" -}}
/etc/pffs/cache-group
{{- end -}}

{{- define "pffs-csi.cacheGroupTlsDir" -}}
/etc/pffs/cache-group-tls
{{- end -}}

{{/* The cache group's Secrets as volumes and their mounts: the same in the plugin and the mounter. */}}
{{- define "pffs-csi.cacheGroupMounts" -}}
{{- if .Values.cacheGroup.enabled }}
- name: cache-group-token
  mountPath: {{ include "pffs-csi.cacheGroupTokenDir" . }}
  readOnly: true
{{- if .Values.cacheGroup.tlsSecret }}
- name: cache-group-tls
  mountPath: {{ include "pffs-csi.cacheGroupTlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{- define "pffs-csi.cacheGroupVolumes" -}}
{{- if .Values.cacheGroup.enabled }}
- name: cache-group-token
  secret:
    secretName: {{ .Values.cacheGroup.tokenSecret }}
    defaultMode: 0400
{{- if .Values.cacheGroup.tlsSecret }}
- name: cache-group-tls
  secret:
    secretName: {{ .Values.cacheGroup.tlsSecret }}
    defaultMode: 0400
{{- end }}
{{- end }}
{{- end -}}

{{- define "pffs-csi.checkCacheGroup" -}}
{{- if and .Values.cacheGroup.enabled (not .Values.hostNetwork) -}}
{{- fail "cacheGroup.enabled needs hostNetwork: true (the mounts serve the group on the node's address)" -}}
{{- end -}}
{{- end -}}
