{{/*
The gateway's state: its database (tenants, API keys, the usage ledger), its limits store, the
ledger's journal. One replica may keep both in the pod (SQLite on a claim, counters in memory);
several must share PostgreSQL and Redis, whose URLs come from Secrets (docs/operators.md).
*/}}

{{/* Refuses values that would split the gateway's state across replicas or put secrets inline. */}}
{{- define "crescent.gatewayChecks" -}}
{{- $v := .Values.gateway }}
{{- $replicas := int $v.replicas }}
{{- $settings := $v.settings | default dict }}
{{- $auth := $settings.auth | default dict }}
{{- if hasKey $auth "database_url" }}
{{- fail "gateway.settings.auth.database_url must not be set: use gateway.database (sqlite on a claim, or postgresql with the URL from a Secret)" }}
{{- end }}
{{- range $name, $key := dict "admin_key" "admin-key" "cache_salt_secret" "cache-salt-secret" }}
{{- if hasKey $auth $name }}
{{- fail (printf "gateway.settings.auth.%s must not be set inline: put it under the key %q of the Secret named in gateway.auth.existingSecret" $name $key) }}
{{- end }}
{{- end }}
{{- if hasKey ($settings.limits | default dict) "store" }}
{{- fail "gateway.settings.limits.store must not be set: use gateway.limits.store (memory, or redis with the URL from a Secret)" }}
{{- end }}
{{- if and (gt $replicas 1) (eq $v.limits.store "memory") }}
{{- fail (printf "gateway.replicas is %d but gateway.limits.store is \"memory\": each replica would count rate limits and budgets on its own, so a client would get %d times its limits. Set gateway.limits.store=redis with the Redis URL in a Secret (gateway.limits.redis.existingSecret), or gateway.replicas=1" $replicas $replicas) }}
{{- end }}
{{- if and (gt $replicas 1) (eq $v.database.type "sqlite") }}
{{- fail (printf "gateway.replicas is %d but gateway.database.type is \"sqlite\": each replica would keep its own SQLite file, with its own API keys and its own part of the usage ledger. Set gateway.database.type=postgresql with the URL in a Secret (gateway.database.postgresql.existingSecret), or gateway.replicas=1" $replicas) }}
{{- end }}
{{- if and (eq $v.database.type "postgresql") (not (include "crescent.gatewayDatabaseSecret" .)) }}
{{- fail (printf "gateway.database.type is postgresql but no Secret holds its URL: set gateway.database.postgresql.existingSecret (or gateway.auth.existingSecret) to a Secret whose key %q is postgresql://user:password@host:5432/db" $v.database.postgresql.urlKey) }}
{{- end }}
{{- if and (eq $v.limits.store "redis") (not (include "crescent.gatewayRedisSecret" .)) }}
{{- fail (printf "gateway.limits.store is redis but no Secret holds its URL: set gateway.limits.redis.existingSecret (or gateway.auth.existingSecret) to a Secret whose key %q is redis://host:6379/0 (or rediss://…)" $v.limits.redis.urlKey) }}
{{- end }}
{{- end }}

{{/* The Secret holding the PostgreSQL URL: its own, else the auth Secret. */}}
{{- define "crescent.gatewayDatabaseSecret" -}}
{{- .Values.gateway.database.postgresql.existingSecret | default .Values.gateway.auth.existingSecret }}
{{- end }}

{{/* The Secret holding the Redis URL: its own, else the auth Secret. */}}
{{- define "crescent.gatewayRedisSecret" -}}
{{- .Values.gateway.limits.redis.existingSecret | default .Values.gateway.auth.existingSecret }}
{{- end }}

{{- define "crescent.gatewayDatabaseClaim" -}}
{{- .Values.gateway.database.sqlite.existingClaim | default (printf "%s-db" (include "crescent.componentName" (dict "root" . "component" "gateway"))) }}
{{- end }}

{{/* One tier of default limits (gateway.limits.key or .tenant) in the gateway's names. */}}
{{- define "crescent.gatewayLimitValues" -}}
{{- $out := dict }}
{{- range $name, $setting := dict "rpm" "rpm" "tpm" "tpm" "maxConcurrent" "max_concurrent" }}
{{- if hasKey $ $name }}{{ $_ := set $out $setting (int (get $ $name)) }}{{ end }}
{{- end }}
{{- if hasKey . "budgetUsd" }}{{ $_ := set $out "budget_usd" (toString .budgetUsd) }}{{ end }}
{{- toYaml $out }}
{{- end }}

{{/* The gateway config's auth, ledger, prices and limits sections (YAML), from values. */}}
{{- define "crescent.gatewayStateSettings" -}}
{{- $v := .Values.gateway }}
{{- $auth := dict "enabled" $v.auth.enabled }}
{{- if not $v.auth.enabled }}
{{- if not $v.auth.allowUnauthenticatedNetwork }}
{{- fail "gateway.auth.enabled=false serves every caller who reaches the gateway keyless, as the default tenant: set gateway.auth.allowUnauthenticatedNetwork=true as well if that is meant (a network you trust), or keep auth on" }}
{{- end }}
{{- $_ := set $auth "allow_unauthenticated_network" true }}
{{- end }}
{{- if eq $v.database.type "sqlite" }}
{{- $_ := set $auth "database_url" (printf "sqlite:///%s/gateway.sqlite3" (trimSuffix "/" $v.database.sqlite.mountPath)) }}
{{- end }}
{{- $l := $v.ledger }}
{{- $ledger := dict "enabled" $l.enabled "durable" $l.durable "commit_wait_s" $l.commitWaitSeconds "batch_rows" (int $l.batchRows) }}
{{- if $l.journalDir }}{{ $_ := set $ledger "journal_dir" $l.journalDir }}{{ end }}
{{- $models := dict }}
{{- range $model, $p := $v.prices }}
{{- $_ := set $models $model (dict "cache_hit_input" (toString $p.cacheHitInput) "cache_miss_input" (toString $p.cacheMissInput) "output" (toString $p.output)) }}
{{- end }}
{{- $m := $v.limits }}
{{- $limits := dict
  "key" (include "crescent.gatewayLimitValues" $m.key | fromYaml)
  "tenant" (include "crescent.gatewayLimitValues" $m.tenant | fromYaml)
  "token_weights" (dict "prompt" $m.tokenWeights.prompt "cached" $m.tokenWeights.cached "completion" $m.tokenWeights.completion)
  "on_store_error" $m.onStoreError
  "store_timeout_s" $m.storeTimeoutSeconds
  "lease_s" $m.leaseSeconds
  "key_prefix" $m.keyPrefix }}
{{- if eq $m.store "memory" }}{{ $_ := set $limits "store" "memory" }}{{ end }}
{{- toYaml (dict "auth" $auth "ledger" $ledger "prices" (dict "models" $models) "limits" $limits) }}
{{- end }}

{{/* Env of the gateway container: its secrets, each from a Secret. */}}
{{- define "crescent.gatewaySecretEnv" -}}
{{- $v := .Values.gateway }}
{{- $authSecret := $v.auth.existingSecret }}
{{- if $authSecret }}
{{- range $key, $setting := dict "admin-key" "ADMIN_KEY" "cache-salt-secret" "CACHE_SALT_SECRET" }}
- name: CRESCENT_GATEWAY__AUTH__{{ $setting }}
  valueFrom: {secretKeyRef: {name: {{ $authSecret | quote }}, key: {{ $key }}, optional: true}}
{{- end }}
{{- end }}
{{- if eq $v.database.type "postgresql" }}
- name: CRESCENT_GATEWAY__AUTH__DATABASE_URL
  valueFrom: {secretKeyRef: {name: {{ include "crescent.gatewayDatabaseSecret" . | quote }}, key: {{ $v.database.postgresql.urlKey | quote }}}}
{{- end }}
{{- if eq $v.limits.store "redis" }}
- name: CRESCENT_GATEWAY__LIMITS__STORE
  valueFrom: {secretKeyRef: {name: {{ include "crescent.gatewayRedisSecret" . | quote }}, key: {{ $v.limits.redis.urlKey | quote }}}}
{{- end }}
{{- end }}

{{- define "crescent.gatewayStateVolumeMounts" -}}
{{- $v := .Values.gateway }}
{{- if eq $v.database.type "sqlite" }}
- {name: database, mountPath: {{ $v.database.sqlite.mountPath }}}
{{- end }}
{{- with $v.ledger.journalDir }}
- {name: ledger-journal, mountPath: {{ . }}}
{{- end }}
{{- end }}

{{- define "crescent.gatewayStateVolumes" -}}
{{- $v := .Values.gateway }}
{{- if eq $v.database.type "sqlite" }}
- name: database
  persistentVolumeClaim:
    claimName: {{ include "crescent.gatewayDatabaseClaim" . }}
{{- end }}
{{- if $v.ledger.journalDir }}
- name: ledger-journal
  emptyDir: {}
{{- end }}
{{- end }}

{{/* gateway.routedPaths as a JSON list, refused when one would route /metrics or /admin: the
Ingress and the HTTPRoute expose these prefixes alone (a prefix matches whole path elements). */}}
{{- define "crescent.gatewayRoutedPaths" -}}
{{- range .Values.gateway.routedPaths }}
{{- $path := trimSuffix "/" . }}
{{- if or (eq $path "") (eq $path "/metrics") (eq $path "/admin") (hasPrefix "/metrics/" $path) (hasPrefix "/admin/" $path) }}
{{- fail (printf "gateway.routedPaths: %q would route the gateway's /metrics or /admin (per-tenant spend, the admin API) to the outside; route the API alone (/v1, /health)" .) }}
{{- end }}
{{- end }}
{{- .Values.gateway.routedPaths | toJson }}
{{- end }}
