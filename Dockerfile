# syntax=docker/dockerfile:1
# One image for every Baton service (`baton serve registry|router|prefill|decode|http`).
#
#   docker build -t baton:cpu .                                   # CPU (default)
#   docker build -t baton:cuda --build-arg VARIANT=cuda .         # CUDA 12 torch build
#
# compose/docker-compose.yml builds it (BATON_VARIANT=cuda for the CUDA variant). The model in
# models/ is baked in; mount another one and set BATON_MODEL_PATH to serve it.
# Nothing here has been built on the machines Baton is developed on (no Docker there); see the
# "Deployment" section of README.md.

ARG VARIANT=cpu
ARG PYTHON_VERSION=3.11
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# --- base images: a Python interpreter, and the matching torch wheel index --------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CUDA_BASE} AS base-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf /usr/bin/python3 /usr/local/bin/python
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

# --- the image ----------------------------------------------------------------------------
FROM base-${VARIANT} AS baton
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# torch first, from the variant's index (its own layer: it is most of the image)
RUN pip install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"

WORKDIR /opt/baton
COPY pyproject.toml README.md ./
COPY baton ./baton
COPY shared ./shared
COPY proto ./proto
COPY services ./services
COPY kernels ./kernels
COPY models ./models
# editable, so the shipped model resolves next to the code (models/baton-tiny)
RUN pip install -e ".[transfer]" && baton config show > /dev/null

RUN useradd --system --uid 10001 --home-dir /opt/baton baton
USER baton
# NATS clients 4222 (outbound only); HTTP frontend 8000; Prometheus metrics 9100 (metrics.port).
# NIXL/UCX over TCP listens on ephemeral ports unless UCX_TCP_PORT_RANGE is set.
EXPOSE 8000 9100
CMD ["baton", "--help"]
