# gasloc for rented GPUs. torch comes from PyPI as its Linux CUDA build (the version the tests run), which
# bundles the CUDA runtime and cuDNN as wheels, so the image needs only the host's NVIDIA driver (>= 525 through CUDA minor-version
# compatibility), injected by the NVIDIA container toolkit (`docker run --gpus all`).
#   docker build -t gasloc .                      (--build-arg TORCH=torch==X to pick another torch build)
#   docker run --init --gpus all -p 31337:31337/tcp -p 31337:31337/udp -v gasloc-ckpt:/data/checkpoints gasloc \
#       peer --port 31337 --initial-peers /ip4/BOOTSTRAP_IP/tcp/31337/p2p/12D3KooW... --run-dir /data/run
# docker-compose.yml beside this file runs a bootstrap node and two peers (docker-compose.gpu.yml adds the GPUs).
# Without Docker Hub or a package index, docker/build.sh builds it with a stand-in base and a local wheelhouse.
# The base: any Debian-like image with Python 3.11 and pip, and `python` on PATH.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG TORCH=torch==2.13.0
# pip's settings for this build only (pip reads PIP_* from the environment). As ARGs they are set while the RUN
# steps below run and are not part of the image's environment; `docker history` shows their values, so give no
# credentials here. PIP_CERT is a CA bundle's path inside the build (the stand-in base carries the host's bundle).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
ARG PIP_CERT
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HF_HOME=/data/hf

WORKDIR /opt/gasloc
COPY docker/install.sh ./

# Layers from the least to the most often changed: torch (pinned), the dependencies from pyproject.toml alone
# (rebuilt only when they change, not on every source edit), then the source installed without dependencies.
RUN bash install.sh torch "$TORCH"
COPY pyproject.toml ./
RUN bash install.sh deps pyproject.toml hf
COPY . src/
RUN bash install.sh package ./src \
    && python -c "import gasloc.peer.train.data as d; assert len(d.embedded_tokens()) > 0" \
    && rm -rf ./src

# An unprivileged user owns the state directories; named volumes mounted there start with this ownership.
RUN groupadd --gid 10001 gasloc \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin gasloc \
    && mkdir -p /data/identity /data/run /data/checkpoints /data/hf /shared \
    && chown -R 10001:10001 /data /shared
USER 10001:10001
WORKDIR /data/run

# The P2P port: libp2p over TCP and QUIC (UDP). Peers inside a compose network need no published port.
EXPOSE 31337/tcp 31337/udp
# identity key (stable peer id), checkpoints, metrics, Hugging Face cache (HF_HOME)
VOLUME ["/data/identity", "/data/checkpoints", "/data/run", "/data/hf"]

# Healthy while the node's p2pd accepts connections on the P2P port; docker-compose.yml also requires a peer to
# write its metrics (every round) and the bootstrap to have written its multiaddrs.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "-m", "gasloc.peer.healthcheck", "--tcp-port", "31337"]

ENTRYPOINT ["gasloc"]
CMD ["--help"]
