# One image for every role; the command picks it (`specserve serve gateway|scheduler|...`).
#   make image       CPU torch (the 2.13.0 CPU wheel)
#   make image-gpu   a CUDA torch: TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TORCH_EXTENSIONS_DIR=/app/kernels

WORKDIR /app
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specserve \
    && pip install --index-url "$TORCH_INDEX" torch==2.13.0
COPY pyproject.toml README.md ./
COPY protos protos
COPY services services
# The generated gRPC code, as `make proto` makes it; then the package itself.
RUN pip install grpcio-tools \
    && mkdir -p /tmp/proto \
    && python -m grpc_tools.protoc -Iprotos --python_out=/tmp/proto --pyi_out=/tmp/proto \
       --grpc_python_out=/tmp/proto protos/specserve/v1/*.proto \
    && cp /tmp/proto/specserve/v1/*.py services/v1/ \
    && rm -rf /tmp/proto \
    && pip install .
# The engine's C++ CPU kernels, built into the image (torch's loader checks the build with the
# compiler and ninja at every start, so g++ stays).
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -m specserve.engine.kernels && chown -R 10001 /app/kernels

USER 10001
# Models are fetched at start (an init container) into /models, a volume.
ENTRYPOINT []
CMD ["specserve", "--help"]
