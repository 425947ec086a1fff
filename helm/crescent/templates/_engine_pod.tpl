{{/*
The pod of an engine group: a Deployment's pods, or a LeaderWorkerSet's leader (worker false)
and workers (worker true). The leader is the instance: it runs the role's service and registers
one instance with the scheduler. Workers carry the component label "<role>-worker", so the
role's headless Service, discovery, PDB and ServiceMonitor never count them as instances; they
run multiNode.workerArgs (by default `crescent serve <role>-worker`: a tensor-parallel rank of
the leader's instance; with backend vllm, vLLM's headless engines for the pod's data-parallel
ranks, _vllm.tpl), and LeaderWorkerSet gives every pod LWS_LEADER_ADDRESS, LWS_GROUP_SIZE
and LWS_WORKER_INDEX, from which the engine's group settings (engine.parallel) default. Call with (dict "root" $ "role" "prefill" "group" <group>
"worker" false).
*/}}
{{- define "crescent.enginePodTemplate" -}}
{{- $root := .root }}
{{- $v := index $root.Values .role }}
{{- $component := dict "root" $root "component" .role }}
{{- $labels := dict "root" $root "component" (ternary (printf "%s-worker" .role) .role (.worker | default false)) }}
{{- $resources := deepCopy $v.resources }}
{{- $gpus := include "crescent.engineGpus" . | int }}
{{- if gt $gpus 0 }}
{{- $limits := get $resources "limits" | default dict }}
{{- $_ := set $limits "nvidia.com/gpu" $gpus }}
{{- $_ = set $resources "limits" $limits }}
{{- end -}}
metadata:
  labels:
    {{- include "crescent.componentLabels" $labels | nindent 4 }}
    crescent.io/group: {{ .group.name }}
    crescent.io/group-key: {{ include "crescent.groupKey" . }}
    {{- with include "crescent.extraPodLabels" (dict "component" .role "values" $v) }}{{ . | nindent 4 }}{{ end }}
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath (printf "/%s-configmap.yaml" .role)) $root | sha256sum }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- include "crescent.podSpecCommon" $root | nindent 2 }}
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with include "crescent.engineNodeSelector" . }}
  nodeSelector:
    {{- . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  affinity:
    {{- include "crescent.engineAffinity" . | nindent 4 }}
  {{- include "crescent.podScheduling" $v | nindent 2 }}
  {{- with include "crescent.weightsInitContainers" (dict "root" $root "component" .role) }}{{ . | trim | nindent 2 }}{{ end }}
  containers:
    - name: {{ .role }}
      image: {{ include "crescent.engineImage" . }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- if and .worker $v.multiNode.workerArgs }}
      args:
        {{- toYaml $v.multiNode.workerArgs | nindent 8 }}
      {{- else if and .worker (include "crescent.isVllm" .) }}
      {{- include "crescent.vllmWorkerCommand" . | nindent 6 }}
      {{- else if .worker }}
      # Crescent's tensor-parallel worker: the role's settings, the rank from LWS_WORKER_INDEX.
      args: [{{ .role }}-worker, --config, /etc/crescent/config.yaml]
      {{- else }}
      args: [{{ .role }}, --config, /etc/crescent/config.yaml]
      {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $v.grpcPort }}
        - name: admin
          containerPort: {{ $v.adminPort }}
        {{- if and (eq .role "decode") (not .worker) }}
        {{- with include "crescent.decodeHandoffSideChannelPort" $root }}
        - name: handoff-side
          containerPort: {{ . }}
        {{- end }}
        {{- end }}
      env:
        {{- include "crescent.baseEnv" $root | nindent 8 }}
        - name: CRESCENT_GROUP
          value: {{ .group.name | quote }}
        {{- if not .worker }}
        # Each pod registers with the scheduler under its own name and pod IP.
        # The id EndpointSlice discovery derives for this pod, so both name one instance.
        - name: CRESCENT_{{ upper .role }}__INSTANCE_ID
          value: {{ .role }}-$(POD_NAME)-{{ $v.grpcPort }}
        - name: CRESCENT_{{ upper .role }}__ADVERTISE_ADDRESS
          value: $(POD_IP):{{ $v.grpcPort }}
        {{- with include "crescent.vllmLeaderEnv" . }}{{ . | trim | nindent 8 }}{{ end }}
        {{- end }}
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if not .worker }}
      {{- include "crescent.probes" (dict "port" "admin" "startupSeconds" $v.startupProbeSeconds) | nindent 6 }}
      {{- include "crescent.preStop" $v | nindent 6 }}
      {{- end }}
      resources:
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        - {name: config, mountPath: /etc/crescent, readOnly: true}
        - {name: tmp, mountPath: /tmp}
        - {name: dshm, mountPath: /dev/shm}
        {{- with include "crescent.weightsVolumeMount" (dict "root" $root "component" .role) }}{{ . | trim | nindent 8 }}{{ end }}
        {{- with include "crescent.tlsVolumeMount" $root }}{{ . | trim | nindent 8 }}{{ end }}
        {{- with $v.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "crescent.componentName" $component }}
    - name: tmp
      emptyDir: {}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.sharedMemorySize }}
    {{- with include "crescent.weightsVolume" (dict "root" $root "component" .role) }}{{ . | trim | nindent 4 }}{{ end }}
    {{- with include "crescent.tlsVolume" $component }}{{ . | trim | nindent 4 }}{{ end }}
    {{- with $v.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
