#!/usr/bin/env bash
# The wheels the lent GPU machine lacks (benchmarks/DEVICE.md), into .whl/ (git-ignored through .git/info/exclude),
# for its Python 3.12 on x86-64. About 45 MB; the tree and the wheels must stay under the device tool's 64 MiB.
#
#   bash benchmarks/device_wheels.sh
set -eu
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    ortools==9.15.6755 immutabledict==4.3.1 protobuf==6.33.6 transformers==5.23.0 pydantic==2.14.4 \
    pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 typing-extensions sybil==10.1.0
du -sh .whl
