{{/*
Node directories the chart mounts (kvstore.ssd.hostPath, model.weights.hostPath). Either way a
hostPath volume needs a namespace at the privileged Pod Security level (baseline forbids
hostPath). hostPaths.ownership decides how the pods' user gets to write them:
- chown: the directory is created root-owned (DirectoryOrCreate) and a root init container
  holding only CAP_CHOWN hands it to runAsUser:runAsGroup;
- prepared: you create it owned by runAsUser on every node beforehand (type Directory: a node
  without it keeps the pod Pending with a clear event); no container runs as root.
*/}}

{{- define "crescent.hostPathType" -}}
{{- if eq .Values.hostPaths.ownership "chown" }}DirectoryOrCreate{{ else }}Directory{{ end }}
{{- end }}

{{/* Call with (dict "root" $ "name" <container> "volume" <volume> "path" <mount path> "image" <image values>). */}}
{{- define "crescent.hostPathChown" -}}
{{- $sc := .root.Values.podSecurityContext }}
- name: {{ .name }}
  image: {{ include "crescent.image" (dict "image" .image) }}
  imagePullPolicy: {{ .image.pullPolicy }}
  command: [chown, "{{ $sc.runAsUser }}:{{ $sc.runAsGroup }}", {{ .path }}]
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: [ALL]
      add: [CHOWN]
  volumeMounts:
    - {name: {{ .volume }}, mountPath: {{ .path }}}
{{- end }}

{{/* The kvstore's SSD tier volume: "hostPath", "ephemeral", or empty (no SSD tier). */}}
{{- define "crescent.kvstoreSsdVolume" -}}
{{- $ssd := .Values.kvstore.ssd }}
{{- if eq $ssd.volume "ephemeral" }}ephemeral{{ else if $ssd.hostPath }}hostPath{{ end }}
{{- end }}

{{/*
Pod Security Standards level a component's pods need: "privileged" when they mount a node
directory (baseline forbids hostPath volumes), else "restricted" (non-root, no added
capabilities, RuntimeDefault seccomp, only emptyDir/configMap/secret/PVC/ephemeral volumes).
*/}}
{{- define "crescent.kvstorePodSecurityLevel" -}}
{{- if eq (include "crescent.kvstoreSsdVolume" .) "hostPath" }}privileged{{ else }}restricted{{ end }}
{{- end }}

{{- define "crescent.enginePodSecurityLevel" -}}
{{- if eq .Values.model.weights.source "hostPath" }}privileged{{ else }}restricted{{ end }}
{{- end }}

{{/* The level the release's namespace must allow: the highest any enabled component needs. */}}
{{- define "crescent.podSecurityLevel" -}}
{{- $engines := or .Values.prefill.enabled .Values.decode.enabled .Values.aggregated.enabled }}
{{- if or (and .Values.kvstore.enabled (eq (include "crescent.kvstorePodSecurityLevel" .) "privileged")) (and $engines (eq (include "crescent.enginePodSecurityLevel" .) "privileged")) }}privileged{{ else }}restricted{{ end }}
{{- end }}
