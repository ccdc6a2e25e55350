# One image for every component: `dynamograph <component>` is the entrypoint, so a pod runs
# `dynamograph worker ...`, `dynamograph frontend ...`, `dynamograph epp ...` or
# `dynamograph operator ...` by its args (the operator writes exactly those into pod specs).
#
#   docker build -t dynamograph:dev .
#   docker run --rm dynamograph:dev worker --engine mock --model Qwen/Qwen3-0.6B --port 8000
#
# It carries the simulated engine (`--engine mock`); `--engine vllm` needs vLLM in the image
# (build FROM a vLLM image with --build-arg BASE=...).
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

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
# A regular (not editable) install; then leave /src so that no source folder (operator/ above
# all) is ever on the import path of the running process.
RUN pip install . && rm -rf /src \
    && useradd --system --uid 10001 --create-home --home-dir /home/dynamograph dynamograph

USER 10001
WORKDIR /home/dynamograph
EXPOSE 8000 8080 5557 5558 9002 9003 9090
ENTRYPOINT ["dynamograph"]
CMD ["--help"]
