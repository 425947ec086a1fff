{{/*
Where engine groups land (docs/operators.md, "Placement"). Two modes:

- zone (default): prefill and decode pods go to any node their pool selects (nvidia.com/gpu.present
  by default, plus any product or zone label the operator adds); a group's pods prefer one zone.
  Nothing is required beyond the pool's own selector, so it schedules on any GPU cluster.
- nvlinkDomain: every pod of a group is required to share one value of topology.supernodeLabel
  (nvidia.com/gpu.clique on GB200/GB300, or a rack label) and, with topology.exclusive, pods of
  other groups are kept out of that domain, as LeaderWorkerSet's exclusive-topology does: a
  required pod affinity within the group plus a required pod anti-affinity against every other
  group key on the domain label.

Every engine pod carries crescent.io/group (the group's name) and crescent.io/group-key
(release and group), which the terms select on. Call the helpers with
(dict "root" $ "role" "prefill" "group" <group values>).
*/}}

{{/* Key of a group across releases: "<release>.<group>", a valid label value. */}}
{{- define "crescent.groupKey" -}}
{{- printf "%s.%s" .root.Release.Name .group.name | trunc 63 | trimSuffix "-" | trimSuffix "." }}
{{- end }}

{{/* Node selector of a group's pods: the role's pool selector plus the group's pins. */}}
{{- define "crescent.engineNodeSelector" -}}
{{- $t := .root.Values.topology }}
{{- $nodeSelector := deepCopy (index .root.Values .role).nodeSelector }}
{{- with .group.supernode }}{{ $_ := set $nodeSelector $t.supernodeLabel . }}{{ end }}
{{- with .group.zone }}{{ $_ := set $nodeSelector $t.zoneLabel . }}{{ end }}
{{- with $nodeSelector }}{{ toYaml . }}{{ end }}
{{- end }}

{{/* Affinity of a group's pods: the role's own affinity plus the terms of the topology mode. */}}
{{- define "crescent.engineAffinity" -}}
{{- $t := .root.Values.topology }}
{{- $affinity := deepCopy (index .root.Values .role).affinity }}
{{- $key := include "crescent.groupKey" . }}
{{- $group := dict "matchLabels" (dict "crescent.io/group-key" $key) }}
{{- $podAffinity := get $affinity "podAffinity" | default dict }}
{{- if eq $t.mode "nvlinkDomain" }}
{{- $required := get $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default list }}
{{- $_ := set $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" (append $required (dict "labelSelector" $group "topologyKey" $t.supernodeLabel)) }}
{{- if $t.exclusive }}
{{- /* NotIn alone would also match pods without the label: Exists keeps it to engine pods. */}}
{{- $others := dict "matchExpressions" (list
  (dict "key" "crescent.io/group-key" "operator" "Exists")
  (dict "key" "crescent.io/group-key" "operator" "NotIn" "values" (list $key))) }}
{{- $podAntiAffinity := get $affinity "podAntiAffinity" | default dict }}
{{- $anti := get $podAntiAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default list }}
{{- $_ = set $podAntiAffinity "requiredDuringSchedulingIgnoredDuringExecution" (append $anti (dict "labelSelector" $others "topologyKey" $t.supernodeLabel)) }}
{{- $_ = set $affinity "podAntiAffinity" $podAntiAffinity }}
{{- end }}
{{- else }}
{{- $preferred := get $podAffinity "preferredDuringSchedulingIgnoredDuringExecution" | default list }}
{{- $term := dict "weight" 100 "podAffinityTerm" (dict "labelSelector" $group "topologyKey" $t.zoneLabel) }}
{{- $_ := set $podAffinity "preferredDuringSchedulingIgnoredDuringExecution" (append $preferred $term) }}
{{- end }}
{{- $_ := set $affinity "podAffinity" $podAffinity }}
{{- toYaml $affinity }}
{{- end }}

{{/* Refuses topologies that cannot schedule or that mean two things. Renders nothing. */}}
{{- define "crescent.validateTopology" -}}
{{- $t := .Values.topology }}
{{- $names := dict }}
{{- $domains := dict }}
{{- range $t.groups }}
{{- if hasKey $names .name }}
{{- fail (printf "topology.groups: the name %q is used twice; each group needs its own name (it names the group's Deployments)" .name) }}
{{- end }}
{{- $_ := set $names .name true }}
{{- $name := .name }}
{{- range $t.groups }}
{{- if regexMatch (printf "^%s-[0-9]+$" $name) .name }}
{{- fail (printf "topology.groups: %s and %s: a LeaderWorkerSet's pods of group %s (<workload>-<instance>-<worker>) would be named like %s's, so the per-group autoscaling queries could not tell them apart; rename one" $name .name $name .name) }}
{{- end }}
{{- end }}
{{- if .supernode }}
{{- if ne $t.mode "nvlinkDomain" }}
{{- fail (printf "topology.groups[%s].supernode pins an NVLink domain, which needs topology.mode: nvlinkDomain (mode %q pins with zone)" .name $t.mode) }}
{{- end }}
{{- if and $t.exclusive (hasKey $domains .supernode) }}
{{- fail (printf "topology.groups: %s and %s are both pinned to %s=%s, but topology.exclusive keeps one group per domain" (get $domains .supernode) .name $t.supernodeLabel .supernode) }}
{{- end }}
{{- $_ := set $domains .supernode .name }}
{{- end }}
{{- end }}
{{- end }}
