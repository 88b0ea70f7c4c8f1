{{/*
Render-time checks: every rule the program applies across fields (and the per-field rules
the schema cannot express), with the program's own messages, so a values file the program
would reject fails `helm template` / `helm install` instead of crash-looping every node.
The messages are the ones extractedprism/config/table.py validate() prints: tests/deploy renders
the chart without this file, feeds the resulting EP_ variables to validate() and compares.
Like the program, all problems are reported at once.
*/}}
{{- define "extractedprism.validate" -}}
{{- $problems := list -}}
{{- $v := .Values -}}

{{- /* --endpoints: templates/_endpoints.tpl holds the program's rules. */ -}}
{{- $endpoints := include "extractedprism.endpointsProblem" . -}}
{{- if $endpoints -}}
{{- $problems = append $problems $endpoints -}}
{{- end -}}

{{- /* Ports. */ -}}
{{- if eq (int64 $v.bindPort) (int64 $v.healthPort) -}}
{{- $problems = append $problems (printf "--bind-port (%d) and --health-port (%d) must differ" (int64 $v.bindPort) (int64 $v.healthPort)) -}}
{{- end -}}

{{- /* Durations: the four timers need at least 1 s, then their pairwise order. */ -}}
{{- $raw := dict
      "health-interval" (toString (default "20s" $v.healthInterval))
      "health-timeout" (toString (default "15s" $v.healthTimeout))
      "liveness-interval" (toString (default "5s" $v.livenessInterval))
      "liveness-threshold" (toString (default "15s" $v.livenessThreshold)) -}}
{{- $sec := dict -}}
{{- range $flag := list "health-interval" "health-timeout" "liveness-interval" "liveness-threshold" -}}
{{- $s := include "extractedprism.seconds" (get $raw $flag) | float64 -}}
{{- $_ := set $sec $flag $s -}}
{{- if lt $s 1.0 -}}
{{- $problems = append $problems (printf "--%s (%s) must be at least 1s" $flag (get $raw $flag)) -}}
{{- end -}}
{{- end -}}
{{- if ge (get $sec "health-timeout") (get $sec "health-interval") -}}
{{- $problems = append $problems (printf "--health-timeout (%s) must be less than --health-interval (%s)" (get $raw "health-timeout") (get $raw "health-interval")) -}}
{{- end -}}
{{- /* --health-recheck: blank is the interval; given, at least 1 s and not above it
(both checked, as the program checks a rule on a value that failed its own check). */ -}}
{{- $recheck := toString (default "" $v.healthRecheck) | trim -}}
{{- if $recheck -}}
{{- $r := include "extractedprism.seconds" $recheck | float64 -}}
{{- if lt $r 1.0 -}}
{{- $problems = append $problems (printf "--health-recheck (%s) must be at least 1s" $recheck) -}}
{{- end -}}
{{- if gt $r (get $sec "health-interval") -}}
{{- $problems = append $problems (printf "--health-recheck (%s) must not be more than --health-interval (%s)" $recheck (get $raw "health-interval")) -}}
{{- end -}}
{{- end -}}
{{- if le (get $sec "liveness-threshold") (get $sec "liveness-interval") -}}
{{- $problems = append $problems (printf "--liveness-threshold (%s) must be greater than --liveness-interval (%s)" (get $raw "liveness-threshold") (get $raw "liveness-interval")) -}}
{{- end -}}

{{- /* Health check and TLS: blank paths count as unset, as in the program. */ -}}
{{- if and (eq (include "extractedprism.healthCheck" .) "readyz") (not (include "extractedprism.healthCheckCaFile" . | trim)) -}}
{{- $problems = append $problems "--health-check=readyz requires --health-check-ca-file" -}}
{{- end -}}
{{- $cert := toString (default "" $v.healthCheckCertFile) | trim -}}
{{- $key := toString (default "" $v.healthCheckKeyFile) | trim -}}
{{- if and $cert (not $key) -}}
{{- $problems = append $problems "--health-check-cert-file and --health-check-key-file must be set together (--health-check-cert-file is set, --health-check-key-file is not)" -}}
{{- else if and $key (not $cert) -}}
{{- $problems = append $problems "--health-check-cert-file and --health-check-key-file must be set together (--health-check-key-file is set, --health-check-cert-file is not)" -}}
{{- end -}}
{{- $serverName := toString (default "" $v.healthCheckServerName) -}}
{{- if and $serverName (not (trim $serverName)) -}}
{{- $problems = append $problems "--health-check-server-name must not be empty" -}}
{{- end -}}

{{- /* The chart's own rules. */ -}}
{{- $drain := include "extractedprism.seconds" (default "0s" $v.shutdownDrainTimeout) | float64 -}}
{{- $grace := include "extractedprism.terminationGrace" . | int64 -}}
{{- if le (float64 $grace) (addf $drain 10) -}}
{{- $problems = append $problems (printf "terminationGracePeriodSeconds (%d) must be more than shutdownDrainTimeout (%s) plus the 10s the shutdown itself may take, or the kubelet kills the pod mid-drain (leave it empty to derive it)" $grace (toString $v.shutdownDrainTimeout)) -}}
{{- end -}}
{{- if $v.adminSocket -}}
{{- $adminDir := dir $v.adminSocket -}}
{{- if has $adminDir (include "extractedprism.hostDirs" . | fromJsonArray) -}}
{{- $problems = append $problems (printf "adminSocket (%s) needs a directory of its own (a per-pod emptyDir), not %s, which is a host directory of handoverSocket or stateFile" $v.adminSocket $adminDir) -}}
{{- end -}}
{{- end -}}
{{- if $v.podMonitor.enabled -}}
{{- $addr := include "extractedprism.healthAddress" . -}}
{{- if or (hasPrefix "127." $addr) (eq $addr "::1") (eq $addr "localhost") -}}
{{- $problems = append $problems (printf "podMonitor.enabled needs a health server Prometheus can reach, but it listens on %s: set healthBindAddress (e.g. 0.0.0.0)" $addr) -}}
{{- end -}}
{{- end -}}

{{- if $problems -}}
{{- fail (printf "extractedprism: invalid configuration: %s" (join "; " $problems)) -}}
{{- end -}}
{{- end -}}
