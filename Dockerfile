# One image for every Baton service (`baton serve registry|router|prefill|decode|http`).
#
#   docker build -t baton:cpu .                                            # CPU, public images and indexes
#   docker build -t baton:cuda --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                --build-arg BUILD_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Offline or behind a mirror, nothing here needs an edit: BASE_IMAGE names any image with python3
# (Debian/Ubuntu ones without it get it from apt), PIP_INDEX_URL / PIP_EXTRA_INDEX_URL /
# PIP_FIND_LINKS / PIP_NO_INDEX / PIP_TRUSTED_HOST are pip's own settings, and TORCH_INDEX_URL is
# where torch comes from. scripts/container_ci.sh builds it that way from a local Debian base and
# a wheel directory served on the host (docs/deployment.md).
#
# compose/docker-compose.yml builds it (BATON_BASE_IMAGE, BATON_TORCH_INDEX_URL pass through).
# The model in models/ is baked in; mount another one and set BATON_MODEL_PATH to serve it.

ARG BASE_IMAGE=python:3.11-slim-bookworm
# The fused CPU ops (kernels/cpu_fused.cpp) are compiled in a stage of their own, whose image has a
# C++ compiler and Python's headers (the full python image has both; a base without them gets them
# from apt); the service image takes only the module (kernels/prebuilt/), no compiler. It must
# have the same Python as BASE_IMAGE.
ARG BUILD_IMAGE=python:3.11-bookworm

FROM ${BUILD_IMAGE} AS fused-ops
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if ! command -v c++ > /dev/null || ! python3 -c "import os, sys, sysconfig; \
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then \
      apt-get update && apt-get install -y --no-install-recommends g++ python3-dev python3-venv \
      && rm -rf /var/lib/apt/lists/* /var/cache/apt/*; fi \
 && python3 -m venv /opt/build \
 && /opt/build/bin/pip install "torch==2.13.0" --index-url "$TORCH_INDEX_URL" \
 && /opt/build/bin/pip install ninja numpy setuptools
COPY kernels /src/baton/kernels
RUN touch /src/baton/__init__.py && cd /src && /opt/build/bin/python -c "from pathlib import Path; \
from baton.kernels import cpu_fused; cpu_fused.build(Path('/out'))" && rm -rf /out/*.o /out/*.built /out/build.ninja /out/.ninja*

FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# a base without Python (nvidia/cuda) gets it from apt
RUN if ! command -v python3 > /dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/* /var/cache/apt/*; fi \
 && python3 -m venv /opt/venv \
 && useradd --system --uid 10001 --home-dir /opt/baton baton

# Baton's dependencies, from pyproject.toml alone (a code change does not reinstall them), in one
# layer with what Baton does not run taken out again: torch's test binaries, headers, test
# libraries and protoc; NIXL's expert-parallel GPU kernels (nixl_ep); sympy, mpmath and networkx,
# which torch needs only for torch.compile / torch.export (the engine uses neither); and the
# symbol tables of libtorch (~100 MB; strip --strip-unneeded keeps the dynamic symbols; binutils
# comes and goes in this step where the base has no strip). torch goes first, from its own
# index: any other source or spec may pull a multi-GB CUDA build.
COPY pyproject.toml /tmp/
RUN pip install "torch==2.13.0" --index-url "$TORCH_INDEX_URL" \
 && python3 -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['transfer']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && sp=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
 && rm -rf "$sp"/torch/test "$sp"/torch/include "$sp"/torch/bin/test_* "$sp"/torch/bin/*Test \
           "$sp"/torch/bin/protoc* "$sp"/torch/lib/lib*test*.so "$sp"/nixl_ep_cu12 /tmp/* \
 && pip uninstall -q -y sympy mpmath networkx \
 && libs="$sp/torch/lib/libtorch_cpu.so $sp/torch/lib/libtorch_python.so" \
 && if command -v strip > /dev/null; then strip --strip-unneeded $libs; \
    else apt-get update && apt-get install -y --no-install-recommends binutils \
      && strip --strip-unneeded $libs && apt-get purge -y --auto-remove binutils \
      && rm -rf /var/lib/apt/lists/* /var/cache/apt/*; fi

WORKDIR /opt/baton
COPY pyproject.toml README.md ./
COPY baton ./baton
COPY shared ./shared
COPY proto ./proto
COPY services ./services
COPY kernels ./kernels
COPY --from=fused-ops /out/ ./kernels/prebuilt/
COPY models ./models
# editable, so the shipped model resolves next to the code (models/baton-tiny); its dependencies
# and setuptools (torch's) are in the venv already, so nothing is fetched here
# the fused ops' module must load here: built for another Python (BUILD_IMAGE not matching
# BASE_IMAGE) it is dropped with a warning, and the services run the ops' torch references
RUN pip install --no-deps --no-build-isolation -e ".[transfer]" && baton config show > /dev/null \
 && { python3 -c "from baton.kernels import cpu_fused; assert cpu_fused._prebuilt() is not None" || { rm -rf \
      kernels/prebuilt; echo "WARNING: the fused CPU ops built in BUILD_IMAGE do not load in BASE_IMAGE" >&2; }; }
USER baton
# glibc's malloc on transparent huge pages, as `baton up` starts its services (shared/process.py
# child_env): a decode step 1.5-3% faster where the host's THP is `madvise` or `always`
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1
# NATS clients 4222 (outbound only); HTTP frontend 8000; Prometheus metrics 9100 (metrics.port).
# NIXL/UCX over TCP listens on ephemeral ports unless UCX_TCP_PORT_RANGE is set.
EXPOSE 8000 9100
CMD ["baton", "--help"]
