{{/* Model weights: baked into the image ("image"), from a PVC ("pvc"), or fetched by an init container ("init"). */}}

{{/* The model spec services are given: the preset id, or the file/directory under the mount. */}}
{{- define "crescent.modelSpec" -}}
{{- $w := .Values.model.weights }}
{{- if eq $w.source "image" }}{{ .Values.model.id }}{{ else }}{{ trimSuffix "/" (printf "%s/%s" $w.mountPath $w.path) }}{{ end }}
{{- end }}

{{- define "crescent.weightsInitContainers" -}}
{{- $w := .Values.model.weights }}
{{- if eq $w.source "init" }}
initContainers:
  - name: fetch-weights
    image: {{ include "crescent.image" $w.init }}
    imagePullPolicy: {{ $w.init.image.pullPolicy }}
    command:
      {{- toYaml $w.init.command | nindent 6 }}
    env:
      - {name: HOME, value: /tmp}
    {{- with $w.init.envFromSecret }}
    envFrom:
      - secretRef: {name: {{ . }}}
    {{- end }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - {name: weights, mountPath: {{ $w.mountPath }}}
      - {name: tmp, mountPath: /tmp}
{{- end }}
{{- end }}

{{- define "crescent.weightsVolumeMount" -}}
{{- if ne .Values.model.weights.source "image" }}
- {name: weights, mountPath: {{ .Values.model.weights.mountPath }}, readOnly: true}
{{- end }}
{{- end }}

{{- define "crescent.weightsVolume" -}}
{{- $w := .Values.model.weights }}
{{- if eq $w.source "pvc" }}
- name: weights
  persistentVolumeClaim:
    claimName: {{ $w.pvc.existingClaim | default (printf "%s-weights" (include "crescent.fullname" .)) }}
    readOnly: true
{{- else if eq $w.source "init" }}
- name: weights
  emptyDir:
    sizeLimit: {{ $w.init.sizeLimit }}
{{- end }}
{{- end }}
