# One image for both programs: `kvrouter` (a router replica) and `fake-kv-worker` (the
# GPU-free engine of the demos and the kind e2e). A pod picks its program with `command:`.
#   docker build -t kvrouter:e2e .
# Runs as uid 10001 (numeric, so `runAsNonRoot` can verify it) on a read-only root fs.

FROM python:3.12-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler for the accelerator (cachetree/_speedups.c, _tables.c), in the build stage only.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# The venv lives where the final image keeps it, so its scripts' shebangs stay valid.
RUN python -m venv /opt/kvrouter
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY cachetree ./cachetree
COPY peer ./peer
COPY router ./router
COPY fake_kv_worker ./fake_kv_worker
# The hf extra lets a real deployment pass --tokenizer with a model's tokenizer.json; the
# fast extra adds uvloop, the replica's event loop by default when installed.
# pip byte-compiles here: the read-only root fs would keep Python from caching it later.
# The accelerator is optional for pip, not for the image: the import fails the build if it
# did not compile.
RUN /opt/kvrouter/bin/pip install '.[hf,fast]' \
    && /opt/kvrouter/bin/python -c "import cachetree._speedups, cachetree._tables" \
    && /opt/kvrouter/bin/pip uninstall --yes pip

FROM python:3.12-slim-bookworm
RUN groupadd --system --gid 10001 kvrouter \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin kvrouter
COPY --from=build /opt/kvrouter /opt/kvrouter
ENV PATH=/opt/kvrouter/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# 8080: kvrouter serve; 8000 and 5557: fake-kv-worker HTTP and rank 0's KV events.
EXPOSE 8080 8000 5557
CMD ["kvrouter", "serve"]
