# ckpt-ferry: `docker build -t ckpt-ferry .` then e.g.
#   docker run --rm -v /nvme/ckpt:/ckpt -e AWS_ENDPOINT_URL -e AWS_ACCESS_KEY_ID \
#     -e AWS_SECRET_ACCESS_KEY ckpt-ferry push /ckpt/step_000100 s3://bucket/prefix --job myjob
# Two stages: the wheel (with the small C extension transfer/codec/_planes.c) is built where a
# compiler is; the image that runs it has none.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY transfer ./transfer
COPY agent ./agent
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels

RUN useradd --create-home --uid 10001 ferry
USER 10001
WORKDIR /home/ferry
ENTRYPOINT ["ferry"]
CMD ["--help"]
