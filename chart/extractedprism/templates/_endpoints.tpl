{{/*
--endpoints, checked at render time by the rules the program applies at start
(extractedprism/config/endpoints.py), with its messages, so a list the program would reject
fails `helm template` / `helm install` instead of crash-looping every node. The value the
program would be given is EP_ENDPOINTS: a list is joined with commas, a string is taken as
written; these helpers check that string exactly as parse_endpoint_list() does.
tests/endpoint_cases.py is the one table of cases both the program's tests and the chart's
render test use.
*/}}

{{/* The string EP_ENDPOINTS would carry, before any tidying: list joined by commas. */}}
{{- define "extractedprism.endpointsRaw" -}}
{{- $raw := .Values.endpoints -}}
{{- if kindIs "slice" $raw -}}
{{- $items := list -}}
{{- range $raw -}}
{{- $items = append $items (toString .) -}}
{{- end -}}
{{- join "," $items -}}
{{- else if kindIs "invalid" $raw -}}
{{- else -}}
{{- toString $raw -}}
{{- end -}}
{{- end -}}

{{/* Python's str.strip(): Go's TrimSpace plus the separators \x1c-\x1f Python counts too. */}}
{{- define "extractedprism.strip" -}}
{{- regexReplaceAll "^[\\t\\n\\v\\f\\r\\x1c-\\x1f \\x{85}\\x{a0}\\p{Z}]+|[\\t\\n\\v\\f\\r\\x1c-\\x1f \\x{85}\\x{a0}\\p{Z}]+$" (toString .) "" -}}
{{- end -}}

{{/* Python's repr() of a string (ASCII escapes), as the program's messages quote values. */}}
{{- define "extractedprism.repr" -}}
{{- $s := toString . -}}
{{- $q := "'" -}}
{{- if and (contains "'" $s) (not (contains "\"" $s)) -}}
{{- $q = "\"" -}}
{{- end -}}
{{- $s = replace "\\" "\\\\" $s -}}
{{- $s = replace "\t" "\\t" $s | replace "\n" "\\n" | replace "\r" "\\r" -}}
{{- range $i := until 32 -}}
{{- if not (has $i (list 9 10 13)) -}}
{{- $s = replace (printf "%c" $i) (printf "\\x%02x" $i) $s -}}
{{- end -}}
{{- end -}}
{{- $s = replace (printf "%c" 127) "\\x7f" $s -}}
{{- if eq $q "'" -}}
{{- $s = replace "'" "\\'" $s -}}
{{- end -}}
{{- printf "%s%s%s" $q $s $q -}}
{{- end -}}

{{/* ipaddress.IPv4Address: four decimal octets 0-255, no leading zeros. "true" or "". */}}
{{- define "extractedprism.isIPv4" -}}
{{- $octet := "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])" -}}
{{- if regexMatch (printf "^%s(\\.%s){3}$" $octet $octet) (toString .) -}}true{{- end -}}
{{- end -}}

{{/*
ipaddress.IPv6Address, step by step as Python parses it: an optional %scope (not empty, no
second %), at least 3 colon-separated parts, an IPv4 tail counting as two hextets, at most 9
parts, at most one "::", leading and trailing ":" only as part of "::", 1-4 hex digits per
hextet. "true" or "".
*/}}
{{- define "extractedprism.isIPv6" -}}
{{- $s := toString . -}}
{{- $ok := true -}}
{{- if contains "%" $s -}}
{{- if regexMatch "^[^%]*%[^%]+$" $s -}}
{{- $s = index (splitList "%" $s) 0 -}}
{{- else -}}
{{- $ok = false -}}
{{- end -}}
{{- end -}}
{{- $parts := splitList ":" $s -}}
{{- if and $ok (lt (len $parts) 3) -}}
{{- $ok = false -}}
{{- end -}}
{{- if and $ok (contains "." (last $parts)) -}}
{{- if include "extractedprism.isIPv4" (last $parts) -}}
{{- $parts = concat (initial $parts) (list "0" "0") -}}
{{- else -}}
{{- $ok = false -}}
{{- end -}}
{{- end -}}
{{- if and $ok (gt (len $parts) 9) -}}
{{- $ok = false -}}
{{- end -}}
{{- $n := len $parts -}}
{{- $skip := -1 -}}
{{- if $ok -}}
{{- range $i, $p := $parts -}}
{{- if and (gt $i 0) (lt $i (sub $n 1)) (eq $p "") -}}
{{- if ge $skip 0 -}}
{{- $ok = false -}}
{{- end -}}
{{- $skip = $i -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $check := list -}}
{{- if $ok -}}
{{- if ge $skip 0 -}}
{{- $hi := $skip -}}
{{- $lo := sub (sub $n $skip) 1 -}}
{{- if eq (index $parts 0) "" -}}
{{- $hi = sub $hi 1 -}}
{{- if ne $hi 0 -}}{{- $ok = false -}}{{- end -}}
{{- end -}}
{{- if eq (last $parts) "" -}}
{{- $lo = sub $lo 1 -}}
{{- if ne $lo 0 -}}{{- $ok = false -}}{{- end -}}
{{- end -}}
{{- if lt (sub 8 (add $hi $lo)) 1 -}}
{{- $ok = false -}}
{{- end -}}
{{- if $ok -}}
{{- range $i, $p := $parts -}}
{{- if or (lt $i $hi) (ge $i (sub $n $lo)) -}}
{{- $check = append $check $p -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- if or (ne $n 8) (eq (index $parts 0) "") (eq (last $parts) "") -}}
{{- $ok = false -}}
{{- end -}}
{{- $check = $parts -}}
{{- end -}}
{{- end -}}
{{- if $ok -}}
{{- range $check -}}
{{- if not (regexMatch "^[0-9a-fA-F]{1,4}$" .) -}}
{{- $ok = false -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $ok -}}true{{- end -}}
{{- end -}}

{{/*
is_valid_host(): an IP address, or an RFC 1123 hostname (at most 253 characters, one root
dot allowed, labels of 1-63 letters, digits and hyphens not starting or ending with a
hyphen) whose top label is not all digits (a mistyped address). "true" or "".
*/}}
{{- define "extractedprism.isHost" -}}
{{- $s := toString . -}}
{{- if or (include "extractedprism.isIPv4" $s) (include "extractedprism.isIPv6" $s) -}}
true
{{- else if and $s (le (len $s) 253) -}}
{{- $name := trimSuffix "." $s -}}
{{- $ok := ne $name "" -}}
{{- range splitList "." $name -}}
{{- if not (regexMatch "^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$" .) -}}
{{- $ok = false -}}
{{- end -}}
{{- end -}}
{{- if and $ok (not (regexMatch "^[0-9]+$" (regexReplaceAll "^.*\\." (regexReplaceAll "\\.+$" $s "") ""))) -}}
true
{{- end -}}
{{- end -}}
{{- end -}}

{{/* parse_port(): the problem with a port, or "". */}}
{{- define "extractedprism.portProblem" -}}
{{- $p := toString . -}}
{{- if not (regexMatch "^[0-9]+$" $p) -}}
{{- printf "port %s is not a number" (include "extractedprism.repr" $p) -}}
{{- else -}}
{{- $digits := regexReplaceAll "^0+" $p "" | default "0" -}}
{{- if or (gt (len $digits) 5) (lt (atoi $digits) 1) (gt (atoi $digits) 65535) -}}
{{- printf "port %s is outside 1-65535" $digits -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* parse_endpoint(): the problem with one non-blank entry, or "". */}}
{{- define "extractedprism.endpointProblem" -}}
{{- $raw := include "extractedprism.strip" . -}}
{{- $r := include "extractedprism.repr" $raw -}}
{{- $scheme := regexFind "^[A-Za-z][A-Za-z0-9+.-]*://" $raw -}}
{{- $host := "" -}}
{{- $port := "" -}}
{{- $problem := "" -}}
{{- if $scheme -}}
{{- $rest := index (splitList "/" (trimPrefix $scheme $raw)) 0 -}}
{{- $problem = printf "%s: a URL scheme (%s) is not allowed: write host:port%s" $r $scheme (ternary (printf ", e.g. %s" $rest) "" (ne $rest "")) -}}
{{- else if hasPrefix "[" $raw -}}
{{- $bracketed := regexFind "^\\[[^\\]]*\\]" $raw -}}
{{- if or (not $bracketed) (not (hasPrefix ":" (trimPrefix $bracketed $raw))) -}}
{{- $problem = printf "%s is not host:port (expected [ipv6]:port)" $r -}}
{{- else -}}
{{- $host = trimSuffix "]" (trimPrefix "[" $bracketed) -}}
{{- $port = trimPrefix ":" (trimPrefix $bracketed $raw) -}}
{{- end -}}
{{- else if not (contains ":" $raw) -}}
{{- $problem = printf "%s is not host:port" $r -}}
{{- else -}}
{{- $host = regexReplaceAll ":[^:]*$" $raw "" -}}
{{- $port = regexFind ":[^:]*$" $raw | trimPrefix ":" -}}
{{- if not $host -}}
{{- $problem = printf "%s is not host:port" $r -}}
{{- else if contains ":" $host -}}
{{- $problem = printf "%s: an IPv6 address must be written in brackets, [addr]:port" $r -}}
{{- end -}}
{{- end -}}
{{- if not $problem -}}
{{- if not (include "extractedprism.isHost" $host) -}}
{{- $problem = printf "%s: host %s is not an IP address or RFC 1123 hostname" $r (include "extractedprism.repr" $host) -}}
{{- else -}}
{{- $portProblem := include "extractedprism.portProblem" $port -}}
{{- if $portProblem -}}
{{- $problem = printf "%s: %s" $r $portProblem -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $problem -}}
{{- end -}}

{{/*
The program's one message about --endpoints (validate() in config/table.py), or "" when it
would accept them. The "required" message adds how to give the value to the chart.
*/}}
{{- define "extractedprism.endpointsProblem" -}}
{{- $value := include "extractedprism.endpointsRaw" . -}}
{{- if not (include "extractedprism.strip" $value) -}}
--endpoints is required: give a comma-separated list of API server host:port pairs (values: endpoints is required, e.g. --set 'endpoints={10.0.0.1:6443,10.0.0.2:6443,10.0.0.3:6443}')
{{- else -}}
{{- $items := splitList "," $value -}}
{{- $problems := list -}}
{{- $any := false -}}
{{- range $items -}}
{{- if include "extractedprism.strip" . -}}
{{- $any = true -}}
{{- end -}}
{{- end -}}
{{- if not $any -}}
{{- printf "--endpoints (%s) must not be empty" $value -}}
{{- else -}}
{{- range $i, $item := $items -}}
{{- if not (include "extractedprism.strip" $item) -}}
{{- $problems = append $problems (printf "entry %d is empty" (add $i 1)) -}}
{{- else -}}
{{- $p := include "extractedprism.endpointProblem" $item -}}
{{- if $p -}}
{{- $problems = append $problems $p -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $problems -}}
{{- printf "--endpoints (%s) is invalid: %s" $value (join "; " $problems) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
EP_ENDPOINTS as rendered: the entries trimmed and joined by commas when the program would
accept them, else exactly what was given (the render-time check then fails the install).
*/}}
{{- define "extractedprism.endpoints" -}}
{{- $value := include "extractedprism.endpointsRaw" . -}}
{{- if include "extractedprism.endpointsProblem" . -}}
{{- $value -}}
{{- else -}}
{{- $items := list -}}
{{- range splitList "," $value -}}
{{- $items = append $items (include "extractedprism.strip" .) -}}
{{- end -}}
{{- join "," $items -}}
{{- end -}}
{{- end -}}
