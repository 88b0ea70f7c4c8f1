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

{{/*
Pod template labels: no chart version and no app version, so a chart bump that changes
nothing in the pod does not roll the pod on every node (the image reference still does).
*/}}
{{- define "extractedprism.podLabels" -}}
{{ include "extractedprism.selectorLabels" . }}
app.kubernetes.io/component: apiserver-proxy
{{- end -}}

{{/*
Discovery needs the API: a ServiceAccount, its token and the Role. With discovery off the
pod gets none of them (empty output means "off").
*/}}
{{- define "extractedprism.discovery" -}}
{{- if .Values.enableDiscovery -}}true{{- end -}}
{{- end -}}

{{- define "extractedprism.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "extractedprism.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The pod's own service-account CA: verifies the API servers for the readyz check. */}}
{{- define "extractedprism.saCaFile" -}}
/var/run/secrets/kubernetes.io/serviceaccount/ca.crt
{{- end -}}

{{/*
The health check actually used: the value, or when empty readyz with discovery (a frozen API
server still accepts TCP; only readyz notices) and tcp without (no token, no CA file).
*/}}
{{- define "extractedprism.healthCheck" -}}
{{- if .Values.healthCheck -}}
{{- .Values.healthCheck -}}
{{- else if .Values.enableDiscovery -}}
readyz
{{- else -}}
tcp
{{- end -}}
{{- end -}}

{{/* The CA file actually used: the value, or the pod's service-account CA for readyz with discovery. */}}
{{- define "extractedprism.healthCheckCaFile" -}}
{{- if .Values.healthCheckCaFile -}}
{{- .Values.healthCheckCaFile -}}
{{- else if and .Values.enableDiscovery (eq (include "extractedprism.healthCheck" .) "readyz") -}}
{{- include "extractedprism.saCaFile" . -}}
{{- end -}}
{{- end -}}

{{/*
--unready-drain-timeout acts only with readyz checks (the program warns that it has no effect
otherwise): render it only then, so a tcp-checked install logs no warning it did not ask for.
*/}}
{{- define "extractedprism.unreadyDrainTimeout" -}}
{{- if eq (include "extractedprism.healthCheck" .) "readyz" -}}
{{- toString (default "" .Values.unreadyDrainTimeout) -}}
{{- end -}}
{{- end -}}

{{/* The state file is read only with discovery (the program warns otherwise): render it only then. */}}
{{- define "extractedprism.stateFile" -}}
{{- if .Values.enableDiscovery -}}
{{- .Values.stateFile -}}
{{- end -}}
{{- end -}}

{{/*
Host directories shared by successive pods of one node: the handover socket's (the new pod
takes the listeners from the old one through it) and the state file's. A list of paths,
without duplicates, as JSON.
*/}}
{{- define "extractedprism.hostDirs" -}}
{{- $dirs := list -}}
{{- range (list .Values.handoverSocket (include "extractedprism.stateFile" .)) -}}
{{- if . -}}
{{- $dirs = append $dirs (dir .) -}}
{{- end -}}
{{- end -}}
{{- $dirs | uniq | toJson -}}
{{- end -}}

{{/*
A Go duration (the schema admits only those) or bare seconds -> seconds, as a float string.
Helm has no duration parser, so the units are summed here the way the program does.
*/}}
{{- define "extractedprism.seconds" -}}
{{- $s := toString . | trim -}}
{{- $units := dict "ns" 1e-9 "us" 1e-6 "µs" 1e-6 "ms" 1e-3 "s" 1.0 "m" 60.0 "h" 3600.0 -}}
{{- $total := 0.0 -}}
{{- if regexMatch "^[0-9]+(\\.[0-9]*)?$" $s -}}
{{- $total = float64 $s -}}
{{- else -}}
{{- range regexFindAll "([0-9]+(\\.[0-9]*)?|\\.[0-9]+)(ns|us|µs|ms|s|m|h)" $s -1 -}}
{{- $num := regexFind "^[0-9.]+" . -}}
{{- $unit := trimPrefix $num . -}}
{{- $total = addf $total (mulf (float64 $num) (get $units $unit)) -}}
{{- end -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{/*
terminationGracePeriodSeconds: the value, or (empty) the shutdown drain window plus the
program's own shutdown budget (5 s proxy + 5 s health server) and a margin.
*/}}
{{- define "extractedprism.terminationGrace" -}}
{{- $drain := include "extractedprism.seconds" .Values.shutdownDrainTimeout | float64 -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- addf (ceil $drain) 15 | int64 -}}
{{- else if eq (toString .Values.terminationGracePeriodSeconds) "" -}}
{{- addf (ceil $drain) 15 | int64 -}}
{{- else -}}
{{- int64 .Values.terminationGracePeriodSeconds -}}
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
spelling of extractedprism/config/table.py FLAGS (tests/deploy/test_chart.py checks that).
*/}}
{{- define "extractedprism.flags" -}}
bind-address: bindAddress
bind-port: bindPort
health-port: healthPort
health-bind-address: healthBindAddress
endpoints: endpoints
health-interval: healthInterval
health-timeout: healthTimeout
health-recheck: healthRecheck
enable-discovery: enableDiscovery
log-level: logLevel
liveness-interval: livenessInterval
liveness-threshold: livenessThreshold
drain-timeout: drainTimeout
unready-drain-timeout: unreadyDrainTimeout
upstream-selection: upstreamSelection
rebalance-interval: rebalanceInterval
rebalance-quiet: rebalanceQuiet
slow-start: slowStart
stall-timeout: stallTimeout
overload-guard: overloadGuard
health-check: healthCheck
health-check-ca-file: healthCheckCaFile
health-check-cert-file: healthCheckCertFile
health-check-key-file: healthCheckKeyFile
health-check-token-file: healthCheckTokenFile
health-check-server-name: healthCheckServerName
kubeconfig: kubeconfig
max-connections: maxConnections
pipe-sched: pipeSched
gil-cpu: gilCpu
relay: relay
dial-hedge-delay: dialHedgeDelay
answer-hedge-delay: answerHedgeDelay
handover-socket: handoverSocket
shutdown-drain-timeout: shutdownDrainTimeout
state-file: stateFile
static-endpoints: staticEndpoints
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
{{- else if eq $key "healthCheck" -}}
{{- $value = include "extractedprism.healthCheck" $ -}}
{{- else if eq $key "healthCheckCaFile" -}}
{{- $value = include "extractedprism.healthCheckCaFile" $ -}}
{{- else if eq $key "stateFile" -}}
{{- $value = include "extractedprism.stateFile" $ -}}
{{- else if eq $key "unreadyDrainTimeout" -}}
{{- $value = include "extractedprism.unreadyDrainTimeout" $ -}}
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
