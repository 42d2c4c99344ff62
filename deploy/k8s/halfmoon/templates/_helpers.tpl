{{/* Names and labels. */}}
{{- define "halfmoon.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "halfmoon.fullname" -}}
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

{{- define "halfmoon.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "halfmoon.labels" -}}
helm.sh/chart: {{ include "halfmoon.chart" . }}
app.kubernetes.io/name: {{ include "halfmoon.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: halfmoon
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "decode"). */}}
{{- define "halfmoon.selectorLabels" -}}
app.kubernetes.io/name: {{ include "halfmoon.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of a component's objects; `halfmoon.io/job` becomes the Prometheus job (ServiceMonitor jobLabel). */}}
{{- define "halfmoon.componentLabels" -}}
{{ include "halfmoon.labels" .root }}
app.kubernetes.io/component: {{ .component }}
halfmoon.io/job: halfmoon-{{ .component }}
{{- end -}}

{{- define "halfmoon.image" -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) .Values.image.tag -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The cache volume source: cache.volume (exactly one source; null entries ignored), else an emptyDir. */}}
{{- define "halfmoon.cacheVolumeSource" -}}
{{- $src := dict -}}
{{- range $k, $v := .Values.cache.volume -}}
{{- if not (kindIs "invalid" $v) -}}{{- $_ := set $src $k $v -}}{{- end -}}
{{- end -}}
{{- if gt (len $src) 1 -}}
{{- fail (printf "cache.volume must hold one volume source, got %v" (keys $src | sortAlpha)) -}}
{{- else if eq (len $src) 0 -}}
{{- $src = dict "emptyDir" (dict "sizeLimit" .Values.cache.sizeLimit) -}}
{{- end -}}
{{- toYaml $src -}}
{{- end -}}

{{/* The registry's etcd key prefix: registry.etcd.prefix, else one per release and namespace. */}}
{{- define "halfmoon.etcdPrefix" -}}
{{- default (printf "/halfmoon/%s/%s/" .Release.Namespace (include "halfmoon.fullname" .)) .Values.registry.etcd.prefix -}}
{{- end -}}

{{- define "halfmoon.registryAddress" -}}
{{- printf "%s-registry:%d" (include "halfmoon.fullname" .) (int .Values.registry.port) -}}
{{- end -}}

{{/*
A component's Deployment. Arguments (dict):
  root       the top-level context ($)
  component  router | prefill | decode | registry
  values     that component's values (.Values.<component>)
  replicas   replica count
  args       container args after `halfmoon` (list of strings)
  ports      list of (dict "name" "grpc" "port" 50051)
  grpcPort   the port serving grpc.health.v1 (probes)
  model      true when the component loads the model (init container pulls it)
  gpus       nvidia.com/gpu count (0: none)
  env        extra EnvVars of this component (list; optional)
  livenessTcp  liveness by TCP connect instead of gRPC health (the router reports NOT_SERVING while it
             knows no healthy worker pair: that must not restart it)
  strategy   Deployment strategy type (RollingUpdate | Recreate)
*/}}
{{/*
A worker's NCCL environment (.Values.ncclEnv as EnvVars, YAML list) when it runs tensor-parallel on
CUDA (values.tp > 1, values.device cuda*); an empty list otherwise. Arguments: root, values.
*/}}
{{- define "halfmoon.tpEnv" -}}
{{- $out := list -}}
{{- if and (gt (int (default 1 .values.tp)) 1) (hasPrefix "cuda" .values.device) -}}
{{- range $k, $val := .root.Values.ncclEnv -}}
{{- $out = append $out (dict "name" $k "value" (toString $val)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{- define "halfmoon.deployment" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $ctx := dict "root" $root "component" .component -}}
{{- $secArgs := include "halfmoon.securityArgs" $ctx | fromJsonArray -}}
{{- $secVols := include "halfmoon.securityVolumes" $ctx | fromJsonArray -}}
{{- /* kubelet's gRPC probes cannot present a client certificate: under mTLS they connect by TCP */ -}}
{{- $tcpProbes := $root.Values.security.tls.enabled -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "halfmoon.fullname" $root }}-{{ .component }}
  labels:
    {{- include "halfmoon.componentLabels" $ctx | nindent 4 }}
spec:
  {{- if not (and (hasKey $v "hpa") $v.hpa.enabled) }}
  replicas: {{ .replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    type: {{ .strategy }}
  selector:
    matchLabels:
      {{- include "halfmoon.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "halfmoon.componentLabels" $ctx | nindent 8 }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      automountServiceAccountToken: false
      {{- if hasKey $v "terminationGracePeriodSeconds" }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if and .model $root.Values.model.pull }}
      initContainers:
        - name: pull-model
          image: {{ include "halfmoon.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args: ["models", "pull", {{ $root.Values.model.name | quote }}]
          envFrom:
            - configMapRef:
                name: {{ include "halfmoon.fullname" $root }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - {name: cache, mountPath: {{ $root.Values.cache.mountPath }}}
            - {name: tmp, mountPath: /tmp}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "halfmoon.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            {{- range .args }}
            - {{ . | quote }}
            {{- end }}
            {{- range $secArgs }}
            - {{ . | quote }}
            {{- end }}
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "halfmoon.fullname" $root }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef: {fieldPath: status.podIP}
            - name: POD_NAME
              valueFrom:
                fieldRef: {fieldPath: metadata.name}
            - name: POD_NAMESPACE
              valueFrom:
                fieldRef: {fieldPath: metadata.namespace}
            {{- with $root.Values.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- range .ports }}
            - name: {{ .name }}
              containerPort: {{ .port }}
              protocol: TCP
            {{- end }}
          startupProbe:
            {{- if $tcpProbes }}
            tcpSocket: {port: {{ .grpcPort }}}
            {{- else }}
            grpc: {port: {{ .grpcPort }}}
            {{- end }}
            periodSeconds: {{ $root.Values.probes.startup.periodSeconds }}
            failureThreshold: {{ $root.Values.probes.startup.failureThreshold }}
          livenessProbe:
            {{- if or .livenessTcp $tcpProbes }}
            tcpSocket: {port: {{ .grpcPort }}}
            {{- else }}
            grpc: {port: {{ .grpcPort }}}
            {{- end }}
            periodSeconds: {{ $root.Values.probes.liveness.periodSeconds }}
            failureThreshold: {{ $root.Values.probes.liveness.failureThreshold }}
          readinessProbe:
            {{- if $tcpProbes }}
            tcpSocket: {port: {{ .grpcPort }}}
            {{- else }}
            grpc: {port: {{ .grpcPort }}}
            {{- end }}
            periodSeconds: {{ $root.Values.probes.readiness.periodSeconds }}
            failureThreshold: {{ $root.Values.probes.readiness.failureThreshold }}
          resources:
            {{- $res := deepCopy (default dict $v.resources) -}}
            {{- if gt (int .gpus) 0 -}}
            {{- $limits := merge (dict "nvidia.com/gpu" (int .gpus)) (default dict $res.limits) -}}
            {{- $_ := set $res "limits" $limits -}}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - {name: cache, mountPath: {{ $root.Values.cache.mountPath }}}
            - {name: tmp, mountPath: /tmp}
            - {name: shm, mountPath: /dev/shm}
            {{- range $secVols }}
            - {name: {{ .name }}, mountPath: {{ .path }}, readOnly: true}
            {{- end }}
      volumes:
        - name: cache
          {{- include "halfmoon.cacheVolumeSource" $root | nindent 10 }}
        - name: tmp
          emptyDir: {}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.shmSize }}
        {{- range $secVols }}
        - name: {{ .name }}
          secret:
            secretName: {{ .secret }}
            defaultMode: 0400
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* A PodDisruptionBudget for a component: (dict "root" $ "component" "decode" "pdb" .Values.decode.pdb). */}}
{{- define "halfmoon.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "halfmoon.fullname" .root }}-{{ .component }}
  labels:
    {{- include "halfmoon.componentLabels" . | nindent 4 }}
spec:
  {{- if hasKey .pdb "minAvailable" }}
  minAvailable: {{ .pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "halfmoon.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* An autoscaling/v2 HPA on a per-pod custom metric: (dict "root" $ "component" "decode" "hpa" .Values.decode.hpa). */}}
{{- define "halfmoon.hpa" -}}
{{- if .hpa.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "halfmoon.fullname" .root }}-{{ .component }}
  labels:
    {{- include "halfmoon.componentLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "halfmoon.fullname" .root }}-{{ .component }}
  minReplicas: {{ .hpa.minReplicas }}
  maxReplicas: {{ .hpa.maxReplicas }}
  metrics:
    - type: Pods
      pods:
        metric:
          name: {{ .hpa.metric }}
        target:
          type: AverageValue
          averageValue: {{ .hpa.averageValue | quote }}
  behavior:
    scaleDown:
      stabilizationWindowSeconds: 300
{{- end }}
{{- end -}}

{{/* Trust (values `security`): Secret names, the flags and the mounts of a component. */}}
{{- define "halfmoon.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "halfmoon.fullname" .)) .Values.security.apiKeys.existingSecret -}}
{{- end -}}

{{- define "halfmoon.clusterTokenSecret" -}}
{{- default (printf "%s-cluster-token" (include "halfmoon.fullname" .)) .Values.security.clusterToken.existingSecret -}}
{{- end -}}

{{/* The TLS Secret of one component: (dict "root" $ "component" "decode"). */}}
{{- define "halfmoon.tlsSecret" -}}
{{- $tls := .root.Values.security.tls -}}
{{- if eq $tls.source "existingSecrets" -}}
{{- $name := get $tls.existingSecrets .component -}}
{{- if not $name -}}{{- fail (printf "security.tls.existingSecrets.%s is required with source existingSecrets" .component) -}}{{- end -}}
{{- $name -}}
{{- else -}}
{{- printf "%s-%s-tls" (include "halfmoon.fullname" .root) .component -}}
{{- end -}}
{{- end -}}

{{/* DNS names a component's certificate holds (its Service, short and qualified). */}}
{{- define "halfmoon.tlsDnsNames" -}}
{{- $svc := printf "%s-%s" (include "halfmoon.fullname" .root) .component -}}
{{- $ns := .root.Release.Namespace -}}
{{- toJson (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns)) -}}
{{- end -}}

{{/* Extra container args of a component for the enabled trust options (a JSON list). */}}
{{- define "halfmoon.securityArgs" -}}
{{- $s := .root.Values.security -}}
{{- $args := list -}}
{{- if and $s.apiKeys.enabled (eq .component "router") -}}
{{- $args = concat $args (list "--api-key-file" (printf "/etc/halfmoon/api-keys/%s" $s.apiKeys.secretKey)) -}}
{{- end -}}
{{- if $s.clusterToken.enabled -}}
{{- $args = concat $args (list "--cluster-token-file" (printf "/etc/halfmoon/cluster-token/%s" $s.clusterToken.secretKey)) -}}
{{- end -}}
{{- if $s.tls.enabled -}}
{{- $args = concat $args (list "--tls-cert" "/etc/halfmoon/tls/tls.crt" "--tls-key" "/etc/halfmoon/tls/tls.key" "--tls-ca" "/etc/halfmoon/tls/ca.crt") -}}
{{- end -}}
{{- toJson $args -}}
{{- end -}}

{{/* Secret volumes of a component for the enabled trust options and the registry's etcd TLS (a JSON list). */}}
{{- define "halfmoon.securityVolumes" -}}
{{- $s := .root.Values.security -}}
{{- $out := list -}}
{{- if and $s.apiKeys.enabled (eq .component "router") -}}
{{- $out = append $out (dict "name" "api-keys" "path" "/etc/halfmoon/api-keys" "secret" (include "halfmoon.apiKeysSecret" .root)) -}}
{{- end -}}
{{- if $s.clusterToken.enabled -}}
{{- $out = append $out (dict "name" "cluster-token" "path" "/etc/halfmoon/cluster-token" "secret" (include "halfmoon.clusterTokenSecret" .root)) -}}
{{- end -}}
{{- if $s.tls.enabled -}}
{{- $out = append $out (dict "name" "tls" "path" "/etc/halfmoon/tls" "secret" (include "halfmoon.tlsSecret" .)) -}}
{{- end -}}
{{- $r := .root.Values.registry -}}
{{- if and (eq .component "registry") (eq $r.backend "etcd") $r.etcd.tls.existingSecret -}}
{{- $out = append $out (dict "name" "etcd-tls" "path" "/etc/halfmoon/etcd-tls" "secret" $r.etcd.tls.existingSecret) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
