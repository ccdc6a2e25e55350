# One image for every component: `dynamograph <component>` is the entrypoint, so a pod runs
# `dynamograph worker ...`, `dynamograph frontend ...`, `dynamograph epp ...` or
# `dynamograph operator ...` by its args (the operator writes exactly those into pod specs).
#
#   docker build -t dynamograph:dev .
#   docker run --rm dynamograph:dev worker --engine mock --model Qwen/Qwen3-0.6B --port 8000
#
# Built as above it carries the simulated engine (`--engine mock`) but no vLLM. The image of a
# graph's `backend: vllm` engine pods (the service's `image`, docs/operator.md "A real vLLM
# graph") is this one on vLLM's official image, where Hub downloads stay on:
#
#   docker build -t REGISTRY/dynamograph-vllm:v0.33.0 \
#       --build-arg BASE=vllm/vllm-openai:v0.33.0 --build-arg HF_HUB_OFFLINE=0 .
#
# HF_HUB_OFFLINE=1 (the default) keeps every component off the Hub: the mock, the frontend and
# the EPP need nothing from it (the embedded vocabulary, or a tokenizer.json they are given),
# while vLLM loads the model's weights (and its tokenizer) from it at first start unless the
# model cache already holds them; 0 is huggingface_hub's "off". (The vLLM build has not been run
# here: the development machine has no Docker daemon and no GPU.)
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG HF_HUB_OFFLINE=1

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=${HF_HUB_OFFLINE}

WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli/ cli/
COPY protocol/ protocol/
COPY router/ router/
COPY epp/ epp/
COPY frontend/ frontend/
COPY worker/ worker/
COPY operator/ operator/
COPY local/ local/
COPY bench/ bench/
# A regular (not editable) install into python3 (in vLLM's image, the interpreter vLLM is in);
# then leave /src so that no source folder (operator/ above all) is ever on the import path of
# the running process.
RUN python3 -m pip install . && rm -rf /src \
    && useradd --system --uid 10001 --create-home --home-dir /home/dynamograph dynamograph

USER 10001
WORKDIR /home/dynamograph
EXPOSE 8000 8080 5557 5558 9002 9003 9090
ENTRYPOINT ["dynamograph"]
CMD ["--help"]
