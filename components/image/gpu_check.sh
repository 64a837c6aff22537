#!/bin/sh
# Read only, for `dsv41-exl3 doctor`: whether a container of the serving image sees the GPU, as the ranks will
# (`docker run --gpus`), when the image is already on the node (the check never pulls 22.5 GiB). Prints `absent`,
# or `exit <status>` then what nvidia-smi -L printed inside the container; image/platforms.py decides.
# Header values (platforms.render_gpu_check):
#   IMAGE      the serving image reference (config `image`)
#   GPUS       docker --gpus (config `gpus`)
#   TIMEOUT_S  bound on the container's run
set -u
if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo absent
  exit 0
fi
# The NVIDIA container runtime mounts nvidia-smi into a container that asks for a GPU.
out=$(timeout "$TIMEOUT_S" docker run --rm --gpus "$GPUS" --entrypoint nvidia-smi "$IMAGE" -L 2>&1)
echo "exit $?"
printf '%s\n' "$out" | tail -n 8
