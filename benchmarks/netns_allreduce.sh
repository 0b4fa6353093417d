#!/usr/bin/env bash
# The two-simulated-hosts part of `python -m benchmarks.allreduce` alone: two network namespaces joined by a
# veth pair shaped with tc tbf, 2 gloo ranks per host. Needs root and iproute2 (skips otherwise).
# The benchmark removes its namespaces on exit, Ctrl-C and SIGTERM; this trap also covers a
# benchmark process that was killed outright.
set -euo pipefail
export AGOQ_NETNS_TAG=$$
trap 'ip netns del "agoq-a$AGOQ_NETNS_TAG" 2>/dev/null || true; ip netns del "agoq-b$AGOQ_NETNS_TAG" 2>/dev/null || true' EXIT
cd "$(dirname "$0")/.."
python -m benchmarks.allreduce --only netns "$@"
