#!/usr/bin/env bash
# End-to-end test of the Docker image (make docker-test; CI runs it after make test).
#
#   1. a Docker engine: uses the running one, else installs Debian's docker.io if needed and starts dockerd
#   2. the base image: python:3.11-slim if present or pullable, else a debootstrap stand-in (cached)
#   3. builds the image with the default model baked in (BAKE_MODEL=1)
#   4. without SIMMER_API_KEY the container refuses to serve on 0.0.0.0
#   5. offline start: --network none, a fresh volume, --memory 1g --cpus 1: healthy from the baked model
#   6. online: the same limits, hardened like compose.yaml, port published on 127.0.0.1; from the host the
#      openai SDK streams a chat completion, /v1/thermal must report the 1 GiB cgroup limit and the engine 1
#      thread; no key -> refused; foreign Host header -> refused
#   7. with SIMMER_DOCKER_ARM64=1 (off by default: emulated, it takes far longer than the rest, and CI runs
#      this script), linux/arm64 from the same Dockerfile, the host made able to run arm64 programs (qemu-user
#      through binfmt_misc) when it is not: `docker buildx build --platform linux/arm64 --load` (the daemon's
#      own `docker build --platform` where buildx is not installed) on an arm64 base (the stand-in made for
#      arm64 when python:3.11-slim cannot be pulled), then the same checks as 6 under emulation, its model
#      volume seeded from the amd64 image (the converted files are the same on every CPU)
#   8. removes what it started (containers, volumes; dockerd if it started it). Keeps the base images and the
#      built images (the layer cache keeps the next run short).
#
# env: SIMMER_DOCKER_IMAGE (simmer:test), SIMMER_BASE_IMAGE (python:3.11-slim), PYTHON (.venv/bin/python),
#      SIMMER_DOCKER_KEEP_DAEMON=1 (leave a dockerd started here running), SIMMER_DOCKER_TIMEOUT (300 s to healthy),
#      SIMMER_DOCKER_ARM64 (0: skip step 7, the default; 1: run it, failing when the host cannot; auto: run
#      it when qemu-user is already registered with binfmt_misc, nothing installed),
#      SIMMER_DOCKER_ARM64_TIMEOUT (1200 s to healthy under emulation)
set -euo pipefail
cd "$(dirname "$0")/.."

image="${SIMMER_DOCKER_IMAGE:-simmer:test}"
wanted_base="${SIMMER_BASE_IMAGE:-python:3.11-slim}"
standin_base="simmer-base:bookworm-py311"
python="${PYTHON:-.venv/bin/python}"
health_timeout="${SIMMER_DOCKER_TIMEOUT:-300}"
memory_bytes=1073741824

run_id="simmer-test-$$"
volume="$run_id-models"
volume_arm64="$run_id-models-arm64"
work="$(mktemp -d /tmp/simmer-docker-test.XXXXXX)"
containers=()
dockerd_pid=""

t0=$(date +%s)
t_step=$t0
step() {
    local now
    now=$(date +%s)
    printf '\n== [%4ds, previous step %3ds] %s\n' "$((now - t0))" "$((now - t_step))" "$*"
    t_step=$now
}

cleanup() {
    local rc=$?
    set +e
    if [ "$rc" -ne 0 ]; then
        for c in "${containers[@]}"; do
            docker inspect "$c" >/dev/null 2>&1 || continue
            echo "--- last log lines of $c"
            docker logs --tail 40 "$c" 2>&1
        done
    fi
    for c in "${containers[@]}"; do docker rm -f -v "$c" >/dev/null 2>&1; done
    docker volume rm -f "$volume" "$volume_arm64" >/dev/null 2>&1
    if [ -n "$dockerd_pid" ] && [ "${SIMMER_DOCKER_KEEP_DAEMON:-0}" != "1" ]; then
        kill "$dockerd_pid" 2>/dev/null
        for _ in $(seq 1 30); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
    fi
    rm -rf "$work"
    step "done (exit code $rc)"
    exit "$rc"
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

"$python" -c 'import openai' 2>/dev/null || fail "$python lacks the openai SDK: run make test (or pip install -e '.[dev]')"

# ---- 1. Docker engine ------------------------------------------------------------------------------------------
step "docker engine"
if ! docker info >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
        echo "installing Debian's docker.io"
        apt-get update -q >"$work/apt.log" 2>&1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >>"$work/apt.log" 2>&1 \
            || { tail -n 20 "$work/apt.log"; fail "apt-get install docker.io"; }
    fi
    dockerd_log=/tmp/simmer-dockerd.log
    echo "starting dockerd (log: $dockerd_log)"
    dockerd >"$dockerd_log" 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$dockerd_pid" 2>/dev/null || { tail -n 20 "$dockerd_log"; fail "dockerd exited"; }
        sleep 1
    done
    docker info >/dev/null 2>&1 || { tail -n 20 "$dockerd_log"; fail "dockerd did not answer in 60 s"; }
fi
docker version --format 'engine {{.Server.Version}}, client {{.Client.Version}}'

# Leftovers of an earlier run that was killed before its trap ran (its PID is in the names).
stale_pid() { local pid=${1#simmer-test-}; pid=${pid%%-*}; ! kill -0 "$pid" 2>/dev/null; }
for c in $(docker ps -a --filter label=org.simmer.test --format '{{.Names}}'); do
    if stale_pid "$c"; then docker rm -f -v "$c" >/dev/null && echo "removed stale container $c"; fi
done
for v in $(docker volume ls -q --filter label=org.simmer.test); do
    if stale_pid "$v"; then docker volume rm -f "$v" >/dev/null && echo "removed stale volume $v"; fi
done

# ---- 2. Base image ---------------------------------------------------------------------------------------------
step "base image"
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
if have_image "$wanted_base"; then
    base="$wanted_base"
elif have_image "$standin_base"; then
    base="$standin_base"
elif timeout 120 docker pull -q "$wanted_base" >/dev/null 2>&1; then
    base="$wanted_base"
else
    echo "$wanted_base is not available (registry unreachable?): building the stand-in $standin_base"
    bash docker/make-base-image.sh "$standin_base"
    base="$standin_base"
fi
echo "base: $base"

# ---- 3. Build --------------------------------------------------------------------------------------------------
step "docker build $image (BAKE_MODEL=1, BASE=$base)"
old_id="$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)"
docker build -f docker/Dockerfile --build-arg BASE="$base" --build-arg BAKE_MODEL=1 -t "$image" . \
    >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; fail "docker build"; }
new_id="$(docker image inspect -f '{{.Id}}' "$image")"
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
    docker rmi "$old_id" >/dev/null 2>&1 || true # the previous build of this tag, now dangling
fi
# The legacy builder keeps each stage's layers as untagged images: tag this build's model stage (a cache hit,
# seconds) so the next run can reuse it, then prune the earlier runs' stages (~700 MB each, labelled in the
# Dockerfile) instead of letting them pile up.
docker build -f docker/Dockerfile --build-arg BASE="$base" --build-arg BAKE_MODEL=1 --target model \
    -t "$image-stage-model" . >>"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; fail "docker build"; }
docker image prune -f --filter label=org.simmer.stage >/dev/null
docker image ls "$image" --format '{{.Repository}}:{{.Tag}} {{.Size}}'

if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
if "${compose[@]}" version >/dev/null 2>&1; then
    SIMMER_API_KEY=check "${compose[@]}" -f docker/compose.yaml config -q || fail "docker/compose.yaml is invalid"
    echo "docker/compose.yaml is valid (${compose[*]})"
    SIMMER_API_KEY=check UPSTREAM_API_KEY=check2 "${compose[@]}" -f docker/compose.routing.yaml config -q \
        || fail "docker/compose.routing.yaml is invalid"
    echo "docker/compose.routing.yaml is valid (${compose[*]})"
fi

api_key="$("$python" -c 'import secrets; print(secrets.token_urlsafe(24))')"
run_opts=(--label org.simmer.test=1 --memory 1g --memory-swap 1g --cpus 1)

wait_healthy() { # container [timeout s] -> waits for Docker's HEALTHCHECK to pass
    local c=$1 status deadline=$((SECONDS + ${2:-$health_timeout}))
    while :; do
        status="$(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$c")"
        case "$status" in
        "running healthy") return 0 ;;
        exited* | dead*) fail "$c stopped before it was healthy ($status)" ;;
        esac
        # The HEALTHCHECK logs /health's body on a 503: a failed model load will not heal, stop waiting.
        if docker inspect -f '{{with .State.Health}}{{range .Log}}{{.Output}}{{end}}{{end}}' "$c" \
            | grep -q -E '"status": *"error"'; then
            fail "$c: model load failed: $(docker inspect -f '{{with .State.Health}}{{range .Log}}{{.Output}}{{end}}{{end}}' "$c" | tail -n 1)"
        fi
        [ "$SECONDS" -lt "$deadline" ] || fail "$c not healthy after ${2:-$health_timeout}s ($status)"
        sleep 2
    done
}

# ---- 4. No key, no service -------------------------------------------------------------------------------------
step "without SIMMER_API_KEY the container refuses to serve on 0.0.0.0"
nokey="$run_id-nokey"
containers+=("$nokey")
set +e
timeout 60 docker run --name "$nokey" --network none "${run_opts[@]}" "$image" >"$work/nokey.log" 2>&1
rc=$?
set -e
docker rm -f -v "$nokey" >/dev/null 2>&1 || true
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || { tail -n 20 "$work/nokey.log"; fail "expected a refusal, exit code $rc"; }
echo "refused (exit code $rc): $(grep -i -m1 -E 'api.?key' "$work/nokey.log" || tail -n 1 "$work/nokey.log")"

# ---- 5. Offline start ------------------------------------------------------------------------------------------
step "offline start: --network none, fresh volume, baked model"
docker volume create --label org.simmer.test=1 "$volume" >/dev/null
offline="$run_id-offline"
containers+=("$offline")
docker run -d --name "$offline" --network none "${run_opts[@]}" --health-interval 2s \
    -e SIMMER_API_KEY="$api_key" -v "$volume":/data "$image" >/dev/null
wait_healthy "$offline"
docker exec "$offline" sh -c 'ls /data' | sed 's/^/volume holds: /'
docker rm -f -v "$offline" >/dev/null

# ---- 6. Online: stream from the host, check the limits ---------------------------------------------------------
step "serve with --memory 1g --cpus 1 on 127.0.0.1 (hardened like compose.yaml)"
port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
online="$run_id-online"
containers+=("$online")
docker run -d --name "$online" "${run_opts[@]}" --health-interval 2s \
    --read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges \
    -p "127.0.0.1:$port:8000" -e SIMMER_API_KEY="$api_key" -v "$volume":/data "$image" >/dev/null
wait_healthy "$online"

step "openai SDK stream + limits + protections (http://127.0.0.1:$port)"
"$python" docker/smoke_client.py --base-url "http://127.0.0.1:$port" --api-key "$api_key" \
    --expect-memory-bytes "$memory_bytes" --expect-threads 1
docker rm -f -v "$online" >/dev/null
echo "PASS (linux/$(docker image inspect -f '{{.Architecture}}' "$image"))"

# ---- 7. linux/arm64 under emulation ----------------------------------------------------------------------------
arm64_mode="${SIMMER_DOCKER_ARM64:-0}"
step "linux/arm64 image under emulation (SIMMER_DOCKER_ARM64=$arm64_mode)"
why_not_arm64=""
if [ "$arm64_mode" = 0 ]; then
    why_not_arm64="SIMMER_DOCKER_ARM64=0 (the default; 1 builds and serves the arm64 image under qemu-user)"
elif [ "$(uname -m)" = aarch64 ]; then
    why_not_arm64="this host is arm64: the image built above is the arm64 one"
elif [ "$arm64_mode" = auto ] && ! grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null; then
    why_not_arm64="qemu-aarch64 is not registered with binfmt_misc (SIMMER_DOCKER_ARM64=1 sets it up)"
else
    # shellcheck source=tests/arm64/host.sh
    source tests/arm64/host.sh
    arm64_host_ready >"$work/arm64-host.log" 2>&1 \
        || why_not_arm64="this host cannot run arm64 programs: $(tail -n 1 "$work/arm64-host.log")"
fi
if [ -n "$why_not_arm64" ]; then
    [ "$arm64_mode" != 1 ] || fail "arm64 required (SIMMER_DOCKER_ARM64=1) but skipped: $why_not_arm64"
    echo "SKIP arm64: $why_not_arm64"
    exit 0
fi

image_arm64="$image-arm64"
is_arm64() { [ "$(docker image inspect -f '{{.Architecture}}' "$1" 2>/dev/null)" = arm64 ]; }
if is_arm64 "$wanted_base"; then
    base_arm64="$wanted_base"
elif is_arm64 "$standin_base-arm64"; then
    base_arm64="$standin_base-arm64"
elif timeout 120 docker pull -q --platform linux/arm64 "$wanted_base" >/dev/null 2>&1 && is_arm64 "$wanted_base"; then
    base_arm64="$wanted_base"
else
    echo "no arm64 $wanted_base (registry unreachable?): building the stand-in $standin_base-arm64 (debootstrap, emulated)"
    bash docker/make-base-image.sh "$standin_base-arm64" linux/arm64
    base_arm64="$standin_base-arm64"
fi
echo "base: $base_arm64 ($(docker image inspect -f '{{.Os}}/{{.Architecture}}' "$base_arm64"))"

step "build $image_arm64 for linux/arm64 (BAKE_MODEL=0: the model volume is seeded from $image)"
if docker buildx version >/dev/null 2>&1; then
    builder=(docker buildx build --load)
else
    echo "docker buildx is not installed: the daemon's builder, docker build --platform linux/arm64"
    builder=(docker build)
fi
old_arm64="$(docker image inspect -f '{{.Id}}' "$image_arm64" 2>/dev/null || true)"
nice -n 19 "${builder[@]}" --platform linux/arm64 -f docker/Dockerfile --build-arg BASE="$base_arm64" \
    -t "$image_arm64" . >"$work/build-arm64.log" 2>&1 || { tail -n 40 "$work/build-arm64.log"; fail "arm64 build"; }
new_arm64="$(docker image inspect -f '{{.Id}}' "$image_arm64")"
if [ -n "$old_arm64" ] && [ "$old_arm64" != "$new_arm64" ]; then docker rmi "$old_arm64" >/dev/null 2>&1 || true; fi
is_arm64 "$image_arm64" || fail "$image_arm64 is not an arm64 image"
docker image ls "$image_arm64" --format '{{.Repository}}:{{.Tag}} {{.Size}}'

step "serve $image_arm64 under emulation (--memory 2g --cpus 2, a Cortex-A76 /proc/cpuinfo)"
docker volume create --label org.simmer.test=1 "$volume_arm64" >/dev/null
docker run --rm --network none -v "$volume_arm64":/data "$image" true # seeds the volume with the baked model
# qemu-user shows the host's x86 /proc/cpuinfo, which onnxruntime cannot read (a real arm64 host has its own)
bash tests/arm64/cpuinfo.sh cortex-a76 >"$work/cpuinfo-arm64"
port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
online_arm64="$run_id-online-arm64"
containers+=("$online_arm64")
docker run -d --name "$online_arm64" --platform linux/arm64 --label org.simmer.test=1 \
    --memory 2g --memory-swap 2g --cpus 2 --health-interval 5s --read-only --tmpfs /tmp --cap-drop ALL \
    --security-opt no-new-privileges -v "$work/cpuinfo-arm64":/proc/cpuinfo:ro \
    -p "127.0.0.1:$port:8000" -e SIMMER_API_KEY="$api_key" -v "$volume_arm64":/data "$image_arm64" >/dev/null
echo "machine in the container: $(docker exec "$online_arm64" uname -m)"
wait_healthy "$online_arm64" "${SIMMER_DOCKER_ARM64_TIMEOUT:-1200}"

step "openai SDK stream + limits + protections, arm64 (http://127.0.0.1:$port)"
"$python" docker/smoke_client.py --base-url "http://127.0.0.1:$port" --api-key "$api_key" \
    --expect-memory-bytes $((2 * memory_bytes)) --expect-threads 2
echo "PASS (linux/arm64 under emulation)"
