{{/*
The vLLM engine backend (<role>.backend: vllm): vLLM's engine inside the role's own process
(`crescent serve <role>`, engine.backend vllm, its arguments in engine.vllm), on image.vllm.
Prefill and decode pools run it together (the handoff goes through the node's kvstore). One
instance may span nodes as a LeaderWorkerSet (<role>.multiNode): the leader runs the Crescent
instance with the first dataParallelSize / nodesPerInstance data-parallel ranks, each worker pod runs
`vllm serve MODEL --headless` for the next ranks and joins the leader's data-parallel group
(vLLM's multi-node data parallel deployment: --data-parallel-size-local, --data-parallel-start-rank,
--data-parallel-address). Call the helpers with (dict "root" $ "role" <role>).
*/}}

{{- define "crescent.isVllm" -}}
{{- if eq (index .root.Values .role).backend "vllm" }}true{{ end }}
{{- end }}

{{/* Data-parallel ranks one pod runs: all of them, or their share on each node of a multi-node instance. */}}
{{- define "crescent.vllmLocalDataParallel" -}}
{{- $v := index .root.Values .role }}
{{- if $v.multiNode.enabled }}{{ div (int $v.vllm.dataParallelSize) (int $v.multiNode.nodesPerInstance) }}{{ else }}{{ int $v.vllm.dataParallelSize }}{{ end }}
{{- end }}

{{/* nvidia.com/gpu of one engine pod: `gpus`, or with backend vllm tensor x pipeline x the pod's data-parallel ranks. */}}
{{- define "crescent.engineGpus" -}}
{{- $v := index .root.Values .role }}
{{- if include "crescent.isVllm" . }}
{{- mul (int $v.vllm.tensorParallelSize) (int $v.vllm.pipelineParallelSize) (int (include "crescent.vllmLocalDataParallel" .)) }}
{{- else }}
{{- int $v.gpus }}
{{- end }}
{{- end }}

{{/* The image of the role's pods: image, or image.vllm with backend vllm (pullPolicy from image). */}}
{{- define "crescent.engineImage" -}}
{{- $v := index .root.Values .role }}
{{- if include "crescent.isVllm" . }}{{ include "crescent.image" (dict "image" $v.image.vllm) }}{{ else }}{{ include "crescent.image" $v }}{{ end }}
{{- end }}

{{/* engine.vllm of the role's config (VllmSettings): every value set, by its snake_case name. A
multi-node leader also gets its local share of the data-parallel ranks; its address comes from
the pod's IP (crescent.vllmLeaderEnv). As JSON. */}}
{{- define "crescent.vllmSettings" -}}
{{- $v := index .root.Values .role }}
{{- $out := dict }}
{{- range $key, $value := $v.vllm }}
{{- if and (not (kindIs "invalid" $value)) (ne $key "engineArgs") }}
{{- $_ := set $out (snakecase $key) $value }}
{{- end }}
{{- end }}
{{- $_ := set $out "gpu_memory_utilization" (float64 $v.vllm.gpuMemoryUtilization) }}
{{- $_ = set $out "cpu_kv_cache_gb" (float64 $v.vllm.cpuKvCacheGb) }}
{{- $args := deepCopy $v.vllm.engineArgs }}
{{- if $v.multiNode.enabled }}
{{- $_ = set $args "data_parallel_size_local" (int (include "crescent.vllmLocalDataParallel" .)) }}
{{- end }}
{{- $_ = set $out "engine_args" $args }}
{{- toJson $out }}
{{- end }}

{{/* The leader of a multi-node vLLM instance: the address its headless workers join (engine_args.data_parallel_address). */}}
{{- define "crescent.vllmLeaderEnv" -}}
{{- if and (include "crescent.isVllm" .) (index .root.Values .role).multiNode.enabled }}
# vLLM's data-parallel front end on this pod; the workers reach it at LWS_LEADER_ADDRESS.
- name: CRESCENT_{{ upper .role }}__ENGINE__VLLM__ENGINE_ARGS__DATA_PARALLEL_ADDRESS
  value: $(POD_IP)
{{- end }}
{{- end }}

{{/* A number as a command-line word: whole numbers without a decimal point or an exponent (Helm
reads YAML numbers as float64, and 1048576 would print as 1.048576e+06). */}}
{{- define "crescent.vllmWord" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) }}{{ int64 . }}{{ else }}{{ toString . }}{{ end }}
{{- end }}

{{/* One engine argument on vllm serve's command line: --kebab-name VALUE, a true flag alone, a false one as --no-NAME, maps and lists as JSON. */}}
{{- define "crescent.vllmFlag" -}}
{{- $flag := printf "--%s" (.name | replace "_" "-") }}
{{- if kindIs "bool" .value }}
{{- list (ternary $flag (printf "--no-%s" (trimPrefix "--" $flag)) .value) | toJson }}
{{- else if or (kindIs "map" .value) (kindIs "slice" .value) }}
{{- list $flag (toJson .value) | toJson }}
{{- else }}
{{- list $flag (include "crescent.vllmWord" .value) | toJson }}
{{- end }}
{{- end }}

{{/* The arguments of `vllm serve MODEL --headless` on a worker pod, after the model: the leader's
engine arguments (crescent.vllmSettings, less the two Crescent-only ones), as a JSON list. The
leader's instance adds a few of its own to every engine (services/engine_vllm/engine.py,
engine_args): the KV block size (engine.block_size, default 64: DEFAULT_BLOCK_SIZE of
services/contract/block_keys.py), prefix caching, guidance for structured outputs and no stats
logging; the workers get the same. Crescent's KV connector is not among them: the instance builds
its options at start (services/engine_vllm/connector_options.py), so the workers' ranks run without it. */}}
{{- define "crescent.vllmWorkerArgs" -}}
{{- $v := index .root.Values .role }}
{{- $m := $v.vllm }}
{{- $args := list "--data-parallel-size" (toString (int $m.dataParallelSize))
                  "--data-parallel-size-local" (include "crescent.vllmLocalDataParallel" .)
                  "--tensor-parallel-size" (toString (int $m.tensorParallelSize))
                  "--pipeline-parallel-size" (toString (int $m.pipelineParallelSize))
                  "--dtype" $m.dtype
                  "--kv-cache-dtype" $m.kvCacheDtype
                  "--gpu-memory-utilization" (include "crescent.vllmWord" $m.gpuMemoryUtilization)
                  "--block-size" (include "crescent.vllmWord" (dig "engine" "block_size" 64 $v.settings))
                  "--enable-prefix-caching"
                  "--structured-outputs-config" (toJson (dict "backend" "guidance"))
                  "--disable-log-stats" }}
{{- if $m.enableExpertParallel }}{{ $args = append $args "--enable-expert-parallel" }}{{ end }}
{{- if $m.enforceEager }}{{ $args = append $args "--enforce-eager" }}{{ end }}
{{- if $m.trustRemoteCode }}{{ $args = append $args "--trust-remote-code" }}{{ end }}
{{- range $key := list "maxModelLen" "quantization" "maxNumSeqs" "maxNumBatchedTokens" }}
{{- $value := index $m $key }}
{{- if not (kindIs "invalid" $value) }}
{{- $args = concat $args (list (printf "--%s" (kebabcase $key)) (include "crescent.vllmWord" $value)) }}
{{- end }}
{{- end }}
{{- range $name, $value := $m.engineArgs }}
{{- $args = concat $args (include "crescent.vllmFlag" (dict "name" $name "value" $value) | fromJsonArray) }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{/* The container of a worker pod of a multi-node vLLM instance: vLLM's own CLI (in the image),
headless, for ranks LWS_WORKER_INDEX x local .. + local - 1. */}}
{{- define "crescent.vllmWorkerCommand" -}}
{{- $local := include "crescent.vllmLocalDataParallel" . }}
# vLLM's headless engines for this pod's data-parallel ranks; the leader's instance serves them.
command:
  - /bin/sh
  - -c
  - exec vllm serve "$0" --headless --data-parallel-address "$LWS_LEADER_ADDRESS" --data-parallel-start-rank "$((LWS_WORKER_INDEX * {{ $local }}))" "$@"
  - {{ include "crescent.modelSpec" .root | quote }}
args:
  {{- range include "crescent.vllmWorkerArgs" . | fromJsonArray }}
  - {{ . | quote }}
  {{- end }}
{{- end }}

{{/* Model names the native engine cannot load (it loads llama-family GGUF and Hugging Face
directories and kimi_k3 / kimi_linear ones): the families vLLM serves and it does not. */}}
{{- define "crescent.notNativePattern" -}}(^|[^a-z0-9])(qwen|deepseek|kimi-k2|gpt-oss|glm|gemma|mistral|mixtral|minimax|phi-?[0-9])
{{- end }}

{{/* Refuses backend values that cannot run. Renders nothing. */}}
{{- define "crescent.validateBackends" -}}
{{- $root := . }}
{{- $w := .Values.model.weights }}
{{- $names := list .Values.model.id }}
{{- if ne $w.source "image" }}{{ $names = append $names $w.path }}{{ end }}
{{- range $role := list "prefill" "decode" "aggregated" }}
{{- $v := index $root.Values $role }}
{{- $engine := get $v.settings "engine" | default dict }}
{{- if and $v.enabled (kindIs "map" $engine) }}
{{- range $key := list "backend" "vllm" }}
{{- if hasKey $engine $key }}
{{- fail (printf "%s.settings.engine.%s: set %s.%s instead (the chart renders engine.%s from it%s)" $role $key $role $key $key (ternary " and passes the same vLLM arguments to multi-node workers" "" (eq $key "vllm"))) }}
{{- end }}
{{- end }}
{{- if and (ne $role "aggregated") $v.enabled }}
{{- $other := index $root.Values (ternary "decode" "prefill" (eq $role "prefill")) }}
{{- if and $other.enabled (ne $v.backend $other.backend) }}
{{- fail (printf "prefill.backend %s and decode.backend %s: a vLLM prefill hands its prompts only to a vLLM decode, and a native one only to a native decode; set both to the same backend" $root.Values.prefill.backend $root.Values.decode.backend) }}
{{- end }}
{{- if and (eq $v.backend "vllm") (not $root.Values.kvstore.enabled) }}
{{- fail (printf "%s.backend: vllm on the pools moves each prompt from prefill to decode through the node's kvstore: set kvstore.enabled=true" $role) }}
{{- end }}
{{- if and (eq $v.backend "vllm") (not $v.vllm.kvConnector) }}
{{- fail (printf "%s.vllm.kvConnector: false leaves a vLLM %s without the handoff (it goes through Crescent's KV connector); keep it true, or serve on aggregated instances" $role $role) }}
{{- end }}
{{- end }}
{{- if eq $v.backend "native" }}
{{- range $name := $names }}
{{- if regexMatch (include "crescent.notNativePattern" $root) (lower $name) }}
{{- fail (printf "%s.backend: native cannot load %q (the native engine loads llama-family GGUF and Hugging Face models and Kimi K3 / Kimi-Linear); serve it with vLLM as aggregated instances: aggregated.enabled=true and aggregated.backend=vllm, with prefill.enabled=false and decode.enabled=false (docs/operators.md, \"Engine backends on GPU pools\")" $role $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq $v.backend "vllm" }}
{{- /* The backend loads a Hugging Face directory, or the embedded GGUF exported to one
(services/engine_vllm/model_dir.py); a bare name is neither. */}}
{{- if and (eq $w.source "image") (ne $root.Values.model.id "smollm2-135m-instruct") }}
{{- fail (printf "%s.backend: vllm loads a Hugging Face directory: give it with model.weights.source (pvc, hostPath or init) and model.weights.path; model.weights.source image serves only the embedded smollm2-135m-instruct, not %q" $role $root.Values.model.id) }}
{{- end }}
{{- if $v.multiNode.enabled }}
{{- $dp := int $v.vllm.dataParallelSize }}
{{- $nodes := int $v.multiNode.nodesPerInstance }}
{{- if or (lt $dp $nodes) (ne (mod $dp $nodes) 0) }}
{{- fail (printf "%s.vllm.dataParallelSize (%d) must be a multiple of %s.multiNode.nodesPerInstance (%d): each pod runs an equal share of the data-parallel ranks (tensor and pipeline parallel groups stay inside a pod)" $role $dp $role $nodes) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
