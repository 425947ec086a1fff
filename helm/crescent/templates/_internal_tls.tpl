{{/* Mutual TLS between the services (docs/security.md).

internalTls.certManager.enabled: cert-manager issues a CA and one certificate per component (its
role in a spiffe://crescent/<role> URI); each pod mounts its Secret at crescent.tlsDir and its
settings point there. Otherwise the services speak plaintext on the pod network, which they
refuse to do on 0.0.0.0 unless internalTls.allowPlaintext sets their override. */}}

{{- define "crescent.tlsDir" -}}/etc/crescent-tls{{- end }}
{{/* The name every component's certificate carries and every client checks (pods are dialled
by IP, which no certificate can list in advance). */}}
{{- define "crescent.tlsServerName" -}}crescent-internal{{- end }}

{{- define "crescent.caName" -}}
{{- printf "%s-internal-ca" (include "crescent.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The tls section of a component's settings, set in .cfg. */}}
{{- define "crescent.internalTlsSettings" -}}
{{- $tls := .root.Values.internalTls }}
{{- if $tls.certManager.enabled }}
{{- $dir := include "crescent.tlsDir" . }}
{{- $_ := set .cfg "tls" (dict "ca" (printf "%s/ca.crt" $dir) "cert" (printf "%s/tls.crt" $dir) "key" (printf "%s/tls.key" $dir) "server_name" (include "crescent.tlsServerName" .)) }}
{{- else if $tls.allowPlaintext }}
{{- $_ := set .cfg "tls" (dict "allow_plaintext_non_loopback" true) }}
{{- end }}
{{- end }}

{{/* The gateway's TLS settings come from the environment (CRESCENT_GATEWAY_TLS__*). */}}
{{- define "crescent.gatewayTlsEnv" -}}
{{- if .Values.internalTls.certManager.enabled }}
{{- $dir := include "crescent.tlsDir" . }}
- {name: CRESCENT_GATEWAY_TLS__CA, value: {{ printf "%s/ca.crt" $dir }}}
- {name: CRESCENT_GATEWAY_TLS__CERT, value: {{ printf "%s/tls.crt" $dir }}}
- {name: CRESCENT_GATEWAY_TLS__KEY, value: {{ printf "%s/tls.key" $dir }}}
- {name: CRESCENT_GATEWAY_TLS__SERVER_NAME, value: {{ include "crescent.tlsServerName" . }}}
{{- end }}
{{- end }}

{{- define "crescent.tlsVolumeMount" -}}
{{- if .Values.internalTls.certManager.enabled }}
- {name: internal-tls, mountPath: {{ include "crescent.tlsDir" . }}, readOnly: true}
{{- end }}
{{- end }}

{{/* dict "root" . "component" "<component>" */}}
{{- define "crescent.tlsVolume" -}}
{{- if .root.Values.internalTls.certManager.enabled }}
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
    - {{ include "crescent.tlsServerName" . }}
    - {{ $name }}
    - {{ $name }}.{{ $root.Release.Namespace }}.svc
    {{- if and (eq .component "scheduler") $root.Values.inferenceExtension.enabled }}
    {{- $picker := include "crescent.componentName" (dict "root" $root "component" "endpoint-picker") }}
    - {{ $picker }}
    - {{ $picker }}.{{ $root.Release.Namespace }}.svc
    {{- end }}
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
