{{/* Mutual TLS between the services (docs/security.md, "In Kubernetes (the Helm chart)").

Two ways to get the certificates, both into Secrets <component>-tls (ca.crt, tls.crt, tls.key)
that each pod mounts at crescent.tlsDir, with settings pointing there:
- internalTls.certManager.enabled: cert-manager issues a CA and one Certificate per component
  (its role in a spiffe://crescent/<role> URI);
- otherwise internalTls.selfSigned.enabled (the default): Helm makes the CA and signs one
  certificate per component at render time (internal-tls-secrets.yaml; the role in the CN).
With neither the services speak plaintext on the pod network, which they refuse to do on 0.0.0.0
unless internalTls.allowPlaintext sets their override; the chart refuses to render that without
allowPlaintext (crescent.validateInternalTls). */}}

{{- define "crescent.tlsDir" -}}/etc/crescent-tls{{- end }}
{{/* The name every component's certificate carries and every client checks (pods are dialled
by IP, which no certificate can list in advance). */}}
{{- define "crescent.tlsServerName" -}}crescent-internal{{- end }}

{{- define "crescent.caName" -}}
{{- printf "%s-internal-ca" (include "crescent.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Where the certificates come from: "cert-manager", "self-signed", or "" (none: plaintext, or
files the operator mounts). Takes the root context. */}}
{{- define "crescent.internalTlsMode" -}}
{{- if .Values.internalTls.certManager.enabled }}cert-manager
{{- else if .Values.internalTls.selfSigned.enabled }}self-signed
{{- end }}
{{- end }}

{{/* Renders nothing: refuses plaintext gRPC that internalTls.allowPlaintext did not ask for.
A component whose settings carry a tls section of its own (files from extraVolumes) is fine. */}}
{{- define "crescent.validateInternalTls" -}}
{{- with .Values.internalTls.selfSigned }}
{{- if gt (int .days) (int .caDays) }}
{{- fail (printf "internalTls.selfSigned.days (%d) must not exceed internalTls.selfSigned.caDays (%d): a certificate would outlive the CA that vouches for it" (int .days) (int .caDays)) }}
{{- end }}
{{- end }}
{{- if not (or (include "crescent.internalTlsMode" .) .Values.internalTls.allowPlaintext) }}
{{- $plain := list }}
{{- range $c := list "scheduler" "prefill" "decode" "aggregated" "kvstore" }}
{{- $v := index $.Values $c }}
{{- if and $v.enabled (not (dig "tls" "ca" "" (default dict $v.settings))) }}
{{- $plain = append $plain $c }}
{{- end }}
{{- end }}
{{- if $plain }}
{{- fail (printf "internalTls: %s would serve plaintext gRPC on the pod network, where any pod that reaches a port may call every RPC (a compromised pod could read every tenant's KV blocks). Turn mutual TLS on with internalTls.selfSigned.enabled=true (the chart makes a CA) or internalTls.certManager.enabled=true, or give each of them a settings.tls of its own; to accept plaintext, set internalTls.allowPlaintext=true (the NetworkPolicies are then the only guard)" (join ", " $plain)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The DNS names of a component's certificate (a JSON list): dict "root" . "component" "<component>".
Pods are dialled by IP, so clients check crescent.tlsServerName; the Service names serve tools that
dial the Service. The scheduler's also names the endpoint picker's Service. */}}
{{- define "crescent.componentDnsNames" -}}
{{- $root := .root }}
{{- $name := include "crescent.componentName" . }}
{{- $names := list (include "crescent.tlsServerName" .) $name (printf "%s.%s.svc" $name $root.Release.Namespace) }}
{{- if and (eq .component "scheduler") $root.Values.inferenceExtension.enabled }}
{{- $picker := include "crescent.componentName" (dict "root" $root "component" "endpoint-picker") }}
{{- $names = concat $names (list $picker (printf "%s.%s.svc" $picker $root.Release.Namespace)) }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/* The tls section of a component's settings, set in .cfg. */}}
{{- define "crescent.internalTlsSettings" -}}
{{- $tls := .root.Values.internalTls }}
{{- if include "crescent.internalTlsMode" .root }}
{{- $dir := include "crescent.tlsDir" . }}
{{- $_ := set .cfg "tls" (dict "ca" (printf "%s/ca.crt" $dir) "cert" (printf "%s/tls.crt" $dir) "key" (printf "%s/tls.key" $dir) "server_name" (include "crescent.tlsServerName" .)) }}
{{- else if $tls.allowPlaintext }}
{{- $_ := set .cfg "tls" (dict "allow_plaintext_non_loopback" true) }}
{{- end }}
{{- end }}

{{/* The gateway's TLS settings come from the environment (CRESCENT_GATEWAY_TLS__*). */}}
{{- define "crescent.gatewayTlsEnv" -}}
{{- if include "crescent.internalTlsMode" . }}
{{- $dir := include "crescent.tlsDir" . }}
- {name: CRESCENT_GATEWAY_TLS__CA, value: {{ printf "%s/ca.crt" $dir }}}
- {name: CRESCENT_GATEWAY_TLS__CERT, value: {{ printf "%s/tls.crt" $dir }}}
- {name: CRESCENT_GATEWAY_TLS__KEY, value: {{ printf "%s/tls.key" $dir }}}
- {name: CRESCENT_GATEWAY_TLS__SERVER_NAME, value: {{ include "crescent.tlsServerName" . }}}
{{- end }}
{{- end }}

{{- define "crescent.tlsVolumeMount" -}}
{{- if include "crescent.internalTlsMode" . }}
- {name: internal-tls, mountPath: {{ include "crescent.tlsDir" . }}, readOnly: true}
{{- end }}
{{- end }}

{{/* Only the component's own Secret; no pod mounts the CA's (<release>-internal-ca).
dict "root" . "component" "<component>" */}}
{{- define "crescent.tlsVolume" -}}
{{- if include "crescent.internalTlsMode" .root }}
- name: internal-tls
  secret:
    secretName: {{ include "crescent.componentName" . }}-tls
    defaultMode: 0440  # root-owned, group fsGroup: the non-root service reads it
{{- end }}
{{- end }}

{{/* One component's Certificate: dict "root" . "component" "<component>" */}}
{{- define "crescent.componentCertificate" -}}
{{- $root := .root }}
{{- $cm := $root.Values.internalTls.certManager }}
{{- if and $cm.enabled (index $root.Values .component "enabled") }}
{{- $name := include "crescent.componentName" . }}
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ $name }}
  labels:
    {{- include "crescent.componentLabels" . | nindent 4 }}
spec:
  secretName: {{ $name }}-tls
  commonName: {{ .component }}
  uris:
    - spiffe://crescent/{{ .component }}
  dnsNames:
    {{- include "crescent.componentDnsNames" . | fromJsonArray | toYaml | nindent 4 }}
  duration: {{ $cm.duration }}
  renewBefore: {{ $cm.renewBefore }}
  privateKey:
    algorithm: ECDSA
    size: 256
    rotationPolicy: Always
  usages: [digital signature, server auth, client auth]
  issuerRef:
    name: {{ include "crescent.caName" $root }}
    kind: Issuer
{{- end }}
{{- end }}
