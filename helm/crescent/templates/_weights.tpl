{{/*
Model weights: baked into the image ("image"), from a PVC ("pvc"), fetched by an init container
into the pod's emptyDir ("init"), or fetched once per node into a node cache directory
("hostPath": the first pod on a node downloads, the others find the marker and skip). The gateway
needs only the tokenizer: with "init" and "hostPath" it fetches into its own emptyDir with
init.gatewayCommand (or init.command), so it never downloads the model to a CPU node's disk.
Call with (dict "root" $ "component" "gateway"|"prefill"|"decode"|"aggregated").
*/}}

{{/* The model spec services are given: the preset id, or the file/directory under the mount. */}}
{{- define "crescent.modelSpec" -}}
{{- $w := .Values.model.weights }}
{{- if eq $w.source "image" }}{{ .Values.model.id }}{{ else }}{{ trimSuffix "/" (printf "%s/%s" $w.mountPath $w.path) }}{{ end }}
{{- end }}

{{/* Whether this pod uses the node cache (engines with source hostPath). */}}
{{- define "crescent.weightsOnNode" -}}
{{- if and (eq .root.Values.model.weights.source "hostPath") (ne .component "gateway") }}true{{ end }}
{{- end }}

{{/* Marker of a finished fetch, named after the command so a changed command fetches again. */}}
{{- define "crescent.weightsMarker" -}}
{{- $w := .Values.model.weights }}
{{- printf "%s/.crescent-fetched-%s" $w.mountPath (toJson $w.init.command | sha256sum | trunc 12) }}
{{- end }}

{{- define "crescent.weightsInitContainers" -}}
{{- with include "crescent.weightsInitItems" . | trim }}
initContainers:
  {{- . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "crescent.weightsInitItems" -}}
{{- $root := .root }}
{{- $w := $root.Values.model.weights }}
{{- if or (eq $w.source "init") (eq $w.source "hostPath") }}
{{- $onNode := include "crescent.weightsOnNode" . }}
{{- if and (eq $w.source "hostPath") (not $w.init.command) }}
{{- fail "model.weights.init.command: give the command that fetches the model into model.weights.mountPath (source hostPath runs it once per node)" }}
{{- end }}
{{- $command := $w.init.command }}
{{- if and (eq .component "gateway") $w.init.gatewayCommand }}{{ $command = $w.init.gatewayCommand }}{{ end }}
{{- if and $onNode (eq $root.Values.hostPaths.ownership "chown") }}
{{ include "crescent.hostPathChown" (dict "root" $root "name" "prepare-weights" "volume" "weights" "path" $w.mountPath "image" (index $root.Values .component).image) }}
{{- end }}
- name: fetch-weights
  image: {{ include "crescent.image" $w.init }}
  imagePullPolicy: {{ $w.init.image.pullPolicy }}
  {{- if $onNode }}
  # Once per node: skip when an earlier pod on this node finished the same fetch.
  command:
    - sh
    - -c
    - 'if [ -f "$0" ]; then echo "weights already on this node"; exit 0; fi; "$@" && touch "$0"'
    - {{ include "crescent.weightsMarker" $root }}
    {{- toYaml $command | nindent 4 }}
  {{- else }}
  command:
    {{- toYaml $command | nindent 4 }}
  {{- end }}
  env:
    - {name: HOME, value: /tmp}
  {{- with $w.init.envFromSecret }}
  envFrom:
    - secretRef: {name: {{ . }}}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: weights, mountPath: {{ $w.mountPath }}}
    - {name: tmp, mountPath: /tmp}
{{- end }}
{{- end }}

{{- define "crescent.weightsVolumeMount" -}}
{{- if ne .root.Values.model.weights.source "image" }}
- {name: weights, mountPath: {{ .root.Values.model.weights.mountPath }}, readOnly: true}
{{- end }}
{{- end }}

{{- define "crescent.weightsVolume" -}}
{{- $root := .root }}
{{- $w := $root.Values.model.weights }}
{{- if eq $w.source "pvc" }}
- name: weights
  persistentVolumeClaim:
    claimName: {{ $w.pvc.existingClaim | default (printf "%s-weights" (include "crescent.fullname" $root)) }}
    readOnly: true
{{- else if include "crescent.weightsOnNode" . }}
- name: weights
  hostPath:
    path: {{ required "model.weights.hostPath: the node directory that caches the weights" $w.hostPath }}
    type: {{ include "crescent.hostPathType" $root }}
{{- else if or (eq $w.source "init") (eq $w.source "hostPath") }}
- name: weights
  emptyDir:
    sizeLimit: {{ ternary $w.init.gatewaySizeLimit $w.init.sizeLimit (eq .component "gateway") }}
{{- end }}
{{- end }}
