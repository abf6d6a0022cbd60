# ckpt-ferry: `docker build -t ckpt-ferry .` then e.g.
#   docker run --rm -v /nvme/ckpt:/ckpt -e AWS_ENDPOINT_URL -e AWS_ACCESS_KEY_ID \
#     -e AWS_SECRET_ACCESS_KEY ckpt-ferry push /ckpt/step_000100 s3://bucket/prefix --job myjob
FROM python:3.11-slim

# No compilers needed: every dependency ships wheels for linux x86_64 and aarch64.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY transfer ./transfer
COPY agent ./agent
RUN pip install --no-cache-dir . && rm -rf /src

RUN useradd --create-home --uid 10001 ferry
USER 10001
WORKDIR /home/ferry
ENTRYPOINT ["ferry"]
CMD ["--help"]
