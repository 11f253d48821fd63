#!/usr/bin/env bash
# The cluster extra (ray[serve], pyproject.toml) for the GPU machine, which cannot reach a
# registry: its wheels for that machine's CPython 3.12 (x86_64), packed and split into chunks of
# at most 48 MiB under .device/ray0, ray1, ... (one transfer carries 64 MiB), with the script that
# joins and installs them there. Issue 56's single-GPU run (two replicas sharing the card).
#
#   bash scripts/stage_device_ray.sh          # here, where PyPI is reachable
#   bash .device/ray0/install-device-ray      # there, once every chunk folder is carried
#
# There, pip installs into the machine's own environment from the chunks alone (--no-index):
# what it already has (numpy, pyyaml, ...) stays, the rest comes from the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
spec=$(python3 -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb"))
print(next(s for s in d["project"]["optional-dependencies"]["cluster"] if s.startswith("ray")))')
cache=${XDG_CACHE_HOME:-$HOME/.cache}/ort-kvlayout-device/ray
rm -rf "$cache" .device/ray[0-9]*
mkdir -p "$cache/wheels" .device
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$cache/wheels" "$spec"
tar -C "$cache/wheels" -cf "$cache/ray.tar" .
split -b 48m -d -a 1 "$cache/ray.tar" "$cache/ray.tar.part."
n=0
for part in "$cache"/ray.tar.part.*; do
  mkdir -p ".device/ray$n" && mv "$part" ".device/ray$n/" && n=$((n + 1))
done
sum=$(sha256sum "$cache/ray.tar" | awk '{print $1}')
cat >.device/ray0/install-device-ray <<SH
#!/usr/bin/env bash
# Joins .device/ray0 .. ray$((n - 1)), checks the sha256 and installs "$spec" from the wheels alone.
set -euo pipefail
cd "\$(dirname "\$0")/../.."
dir=\$(mktemp -d)
cat .device/ray[0-9]*/ray.tar.part.* >"\$dir/ray.tar"
echo "$sum  \$dir/ray.tar" | sha256sum -c --quiet
tar -C "\$dir" -xf "\$dir/ray.tar"
python3 -m pip install -q --no-index --find-links "\$dir" "$spec"
python3 -c 'import ray, ray.serve; print("ray", ray.__version__)'
SH
du -sh "$cache/ray.tar"
echo "staged $n chunks: .device/ray0 .. .device/ray$((n - 1)); there: bash .device/ray0/install-device-ray"
