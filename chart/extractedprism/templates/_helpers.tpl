{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "extractedprism.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release-chart, or the release name alone when it already contains the chart name. */}}
{{- define "extractedprism.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "extractedprism.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "extractedprism.selectorLabels" -}}
app.kubernetes.io/name: {{ include "extractedprism.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "extractedprism.labels" -}}
helm.sh/chart: {{ include "extractedprism.chart" . }}
{{ include "extractedprism.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: apiserver-proxy
{{- end -}}

{{- define "extractedprism.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "extractedprism.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "extractedprism.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/*
The endpoints as one comma-separated string, from a list or a string. Fails the render
with a usable message when none are given: the proxy cannot start without them.
*/}}
{{- define "extractedprism.endpoints" -}}
{{- $raw := .Values.endpoints -}}
{{- $items := list -}}
{{- if kindIs "slice" $raw -}}
{{- range $raw -}}
{{- $items = append $items (toString . | trim) -}}
{{- end -}}
{{- else if $raw -}}
{{- range (splitList "," (toString $raw)) -}}
{{- $items = append $items (trim .) -}}
{{- end -}}
{{- end -}}
{{- $items = compact $items -}}
{{- if not $items -}}
{{- fail "endpoints is required: set the API servers this proxy forwards to, e.g. --set 'endpoints={10.0.0.1:6443,10.0.0.2:6443,10.0.0.3:6443}'" -}}
{{- end -}}
{{- join "," $items -}}
{{- end -}}

{{/* The address the health server listens on (health-bind-address falls back to bind-address). */}}
{{- define "extractedprism.healthAddress" -}}
{{- default .Values.bindAddress .Values.healthBindAddress -}}
{{- end -}}

{{/*
The host the kubelet probes. The pod shares the node's network, so a loopback listener is
reached at the loopback address; a wildcard listener is reached there too.
*/}}
{{- define "extractedprism.probeHost" -}}
{{- $addr := include "extractedprism.healthAddress" . -}}
{{- if eq $addr "0.0.0.0" -}}
127.0.0.1
{{- else if eq $addr "::" -}}
::1
{{- else -}}
{{- $addr -}}
{{- end -}}
{{- end -}}

{{/*
flag name -> values key; the single list behind the EP_ variables. Keep it in the order and
spelling of extractedprism/config.py FLAGS (tests/deploy/test_chart.py checks that).
*/}}
{{- define "extractedprism.flags" -}}
bind-address: bindAddress
bind-port: bindPort
health-port: healthPort
health-bind-address: healthBindAddress
endpoints: endpoints
health-interval: healthInterval
health-timeout: healthTimeout
enable-discovery: enableDiscovery
log-level: logLevel
liveness-interval: livenessInterval
liveness-threshold: livenessThreshold
drain-timeout: drainTimeout
upstream-selection: upstreamSelection
health-check: healthCheck
health-check-ca-file: healthCheckCaFile
health-check-cert-file: healthCheckCertFile
health-check-key-file: healthCheckKeyFile
health-check-token-file: healthCheckTokenFile
health-check-server-name: healthCheckServerName
kubeconfig: kubeconfig
max-connections: maxConnections
pipe-sched: pipeSched
log-format: logFormat
admin-socket: adminSocket
{{- end -}}

{{/* Integer-valued keys: printed as whole numbers even when values arrive as floats (JSON). */}}
{{- define "extractedprism.intKeys" -}}
{{- list "bindPort" "healthPort" "maxConnections" | toJson -}}
{{- end -}}

{{/* One EnvVar per flag with a value; empty strings keep the program's default. */}}
{{- define "extractedprism.env" -}}
{{- $flags := include "extractedprism.flags" . | fromYaml -}}
{{- $intKeys := include "extractedprism.intKeys" . | fromJsonArray -}}
{{- range $flag, $key := $flags }}
{{- $env := printf "EP_%s" ($flag | upper | replace "-" "_") -}}
{{- $value := index $.Values $key -}}
{{- if eq $key "endpoints" -}}
{{- $value = include "extractedprism.endpoints" $ -}}
{{- else if kindIs "bool" $value -}}
{{- $value = ternary "true" "false" $value -}}
{{- else if has $key $intKeys -}}
{{- $value = int64 $value | toString -}}
{{- else if not (kindIs "invalid" $value) -}}
{{- $value = toString $value -}}
{{- else -}}
{{- $value = "" -}}
{{- end -}}
{{- if ne $value "" }}
- name: {{ $env }}
  value: {{ $value | quote }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Render-time checks that mirror the program's validation, so a bad install fails at helm time. */}}
{{- define "extractedprism.validate" -}}
{{- $_ := include "extractedprism.endpoints" . -}}
{{- if and (eq .Values.healthCheck "readyz") (not .Values.healthCheckCaFile) -}}
{{- fail "healthCheck=readyz requires healthCheckCaFile (e.g. /var/run/secrets/kubernetes.io/serviceaccount/ca.crt)" -}}
{{- end -}}
{{- if and .Values.healthCheckCertFile (not .Values.healthCheckKeyFile) -}}
{{- fail "healthCheckCertFile and healthCheckKeyFile must be set together (healthCheckKeyFile is empty)" -}}
{{- end -}}
{{- if and .Values.healthCheckKeyFile (not .Values.healthCheckCertFile) -}}
{{- fail "healthCheckCertFile and healthCheckKeyFile must be set together (healthCheckCertFile is empty)" -}}
{{- end -}}
{{- if eq (int64 .Values.bindPort) (int64 .Values.healthPort) -}}
{{- fail "bindPort and healthPort must differ" -}}
{{- end -}}
{{- if .Values.podMonitor.enabled -}}
{{- $addr := include "extractedprism.healthAddress" . -}}
{{- if or (hasPrefix "127." $addr) (eq $addr "::1") (eq $addr "localhost") -}}
{{- fail (printf "podMonitor.enabled needs a health server Prometheus can reach, but it listens on %s: set healthBindAddress (e.g. 0.0.0.0)" $addr) -}}
{{- end -}}
{{- end -}}
{{- end -}}
