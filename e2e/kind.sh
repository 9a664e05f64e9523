#!/usr/bin/env bash
# End to end on a kind cluster, CPU only: build both images, load them into kind, install the
# chart, stage a tiny generated Llama checkpoint from a PVC at TP=1, roll a CPU vLLM Deployment
# onto it, then change TP to 2 and watch the stage-before-roll (the old pods keep serving the
# old artifact until the new one is complete). Not run in CI; see e2e/README.md.
#
#   e2e/kind.sh            create (or reuse) the cluster and run everything
#   e2e/kind.sh --clean    delete the cluster afterwards
#
# Needs docker, kind, and helm + kubectl (scripts/tools installs both). Environment:
#   CLUSTER (modelstage-e2e), NAMESPACE (modelstage-e2e), VLLM_IMAGE (a CPU build of vLLM 0.32),
#   TORCH_INDEX_URL (PyTorch's CPU wheel index, for a small stager image), TIMEOUT (900s).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER="${CLUSTER:-modelstage-e2e}"
NAMESPACE="${NAMESPACE:-modelstage-e2e}"
RELEASE="${RELEASE:-modelstage}"
TAG="${TAG:-e2e}"
VLLM_IMAGE="${VLLM_IMAGE:-vllm-cpu:0.32.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
TIMEOUT="${TIMEOUT:-900s}"
CLEAN=0
if [ "${1:-}" = "--clean" ]; then CLEAN=1; fi

TOOLS_BIN="$(./scripts/tools)"
export PATH="$TOOLS_BIN:$PATH"
for tool in docker kind helm kubectl; do
  command -v "$tool" >/dev/null || { echo "e2e: $tool is needed" >&2; exit 1; }
done

log() { printf '\n== %s\n' "$*" >&2; }
md_phase() { kubectl -n "$NAMESPACE" get md tiny-llama -o jsonpath='{.status.phase}' 2>/dev/null; }
wait_phase() {
  local want="$1" deadline=$((SECONDS + ${TIMEOUT%s}))
  until [ "$(md_phase)" = "$want" ]; do
    if [ "$(md_phase)" = "Failed" ]; then
      kubectl -n "$NAMESPACE" describe md tiny-llama >&2
      exit 1
    fi
    [ "$SECONDS" -lt "$deadline" ] || { echo "e2e: timed out waiting for $want" >&2; exit 1; }
    sleep 5
  done
}
digest_of_template() {
  kubectl -n "$NAMESPACE" get deploy vllm-tiny \
    -o jsonpath='{.spec.template.metadata.annotations.modelstage\.io/artifact-digest}'
}

if [ "$CLEAN" = 1 ]; then
  trap 'kind delete cluster --name "$CLUSTER"' EXIT
fi

log "cluster $CLUSTER"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s

log "images"
docker build -f Dockerfile.operator -t "modelstage-operator:$TAG" .
docker build -f Dockerfile.stager -t "modelstage-stager:$TAG" \
  --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" .
kind load docker-image --name "$CLUSTER" "modelstage-operator:$TAG" "modelstage-stager:$TAG"
if docker image inspect "$VLLM_IMAGE" >/dev/null 2>&1; then
  kind load docker-image --name "$CLUSTER" "$VLLM_IMAGE"
fi

log "CRDs and chart (the CRD upgrade path first, as on every upgrade)"
kubectl apply --server-side -f charts/modelstage/crds/
# The operator serves the test namespace only (a Role there): it must exist first.
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
helm upgrade --install "$RELEASE" charts/modelstage \
  --namespace modelstage-system --create-namespace \
  --set image.repository=modelstage-operator --set image.tag="$TAG" \
  --set image.pullPolicy=Never \
  --set stagerImage.repository=modelstage-stager --set stagerImage.tag="$TAG" \
  --set "watch.namespaces={$NAMESPACE}" \
  --wait --timeout 5m
kubectl -n modelstage-system rollout status "deployment/$RELEASE" --timeout=5m

log "a tiny generated checkpoint on a PVC"
kubectl apply -n "$NAMESPACE" -f - <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: models}
spec:
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 2Gi}}
---
apiVersion: batch/v1
kind: Job
metadata: {name: make-tiny-llama}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      securityContext: {runAsNonRoot: true, runAsUser: 65532, fsGroup: 65532,
                        seccompProfile: {type: RuntimeDefault}}
      containers:
        - name: make
          image: modelstage-stager:$TAG
          imagePullPolicy: Never
          # \`modelstage demo\` generates a random Llama checkpoint (nothing is downloaded).
          command: [modelstage, demo, --workdir, /models/demo]
          securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
          volumeMounts: [{name: models, mountPath: /models}]
      volumes: [{name: models, persistentVolumeClaim: {claimName: models}}]
EOF
kubectl -n "$NAMESPACE" wait --for=condition=complete job/make-tiny-llama --timeout="$TIMEOUT"
# kind's single node makes ReadWriteOnce shareable by the stager and vLLM pods.
SOURCE_PATH="demo/checkpoint"

log "a CPU vLLM Deployment that serves the checkpoint as it is"
# The annotation opts the workload in: only the ModelDeployment it names may patch it.
kubectl apply -n "$NAMESPACE" -f - <<EOF
apiVersion: apps/v1
kind: Deployment
metadata:
  name: vllm-tiny
  labels: {app: vllm-tiny}
  annotations: {modelstage.io/model-deployment: tiny-llama}
spec:
  replicas: 1
  strategy: {type: RollingUpdate, rollingUpdate: {maxSurge: 1, maxUnavailable: 0}}
  selector: {matchLabels: {app: vllm-tiny}}
  template:
    metadata: {labels: {app: vllm-tiny}}
    spec:
      containers:
        - name: vllm
          image: $VLLM_IMAGE
          imagePullPolicy: IfNotPresent
          command: [vllm, serve]
          args: [/models/$SOURCE_PATH, --tensor-parallel-size=1, --dtype=float32,
                 --skip-tokenizer-init, --max-model-len=256]
          env:
            - {name: VLLM_CPU_KVCACHE_SPACE, value: "1"}
            - {name: MODELSTAGE_METRICS_PORT, value: "9400"}
          ports: [{name: http, containerPort: 8000}]
          readinessProbe: {httpGet: {path: /health, port: http}, periodSeconds: 5}
          volumeMounts: [{name: models, mountPath: /models, readOnly: true}]
      volumes: [{name: models, persistentVolumeClaim: {claimName: models}}]
EOF

log "the ModelDeployment at TP=1"
apply_md() {
  kubectl apply -n "$NAMESPACE" -f - <<EOF
apiVersion: modelstage.io/v1alpha1
kind: ModelDeployment
metadata: {name: tiny-llama}
spec:
  model: {uri: "pvc://models/$SOURCE_PATH"}
  parallelism: {tensor: $1}
  dtype: float32
  loadFormat: sharded_state
  storage: {pvc: {claimName: models, path: /artifacts}}
  serving:
    targetRef: {kind: Deployment, name: vllm-tiny}
    containerName: vllm
  retention: {keep: 2}
EOF
}
apply_md 1
wait_phase Ready
kubectl -n "$NAMESPACE" rollout status deploy/vllm-tiny --timeout="$TIMEOUT"
first="$(digest_of_template)"
echo "serving artifact $first" >&2

log "TP 1 -> 2: a new artifact is staged while the old one keeps serving"
apply_md 2
# Stage before roll: as long as the new artifact is staging, the pod template names the old one.
saw_staging=0
deadline=$((SECONDS + ${TIMEOUT%s}))
while :; do
  phase="$(md_phase)"
  template="$(digest_of_template)"
  case "$phase" in
    Pending|Staging|Staged)
      [ "$template" = "$first" ] || { echo "e2e: the workload moved before staging finished" >&2; exit 1; }
      if [ "$phase" = Staging ]; then saw_staging=1; fi ;;
    Ready)
      if [ "$template" != "$first" ]; then break; fi ;;
    Failed)
      kubectl -n "$NAMESPACE" describe md tiny-llama >&2
      exit 1 ;;
  esac
  [ "$SECONDS" -lt "$deadline" ] || { echo "e2e: timed out in phase $phase" >&2; exit 1; }
  sleep 2
done
[ "$saw_staging" = 1 ] || echo "e2e: staging finished between two polls (the order still held)" >&2
kubectl -n "$NAMESPACE" get jobs -l app.kubernetes.io/component=stager
kubectl -n "$NAMESPACE" rollout status deploy/vllm-tiny --timeout="$TIMEOUT"
second="$(digest_of_template)"
[ "$second" != "$first" ] || { echo "e2e: the workload did not move to the new artifact" >&2; exit 1; }
kubectl -n "$NAMESPACE" get md tiny-llama -o wide
kubectl -n "$NAMESPACE" get deploy vllm-tiny -o jsonpath='{.spec.template.spec.containers[0].args}'
echo
log "passed: $first -> $second, staged before the roll"
