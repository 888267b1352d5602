# Serving image for the sentiment endpoint: TorchServe + the packaged model archive behind nginx, nothing else.
# Build after `make run` (it writes model_store/sentiment.mar):
#   docker build -t sentiment-serve .
#   docker run --rm -p 127.0.0.1:8080:8080 sentiment-serve
# Ports: 8080 is nginx (serving/nginx.conf), which passes only POST /predictions/sentiment to TorchServe's inference
# API on 127.0.0.1:8079 (TorchServe cannot refuse other methods itself); 8082 metrics. Management (8081) and gRPC
# (7070/7071) stay on the container's loopback. Publish 8080 only to 127.0.0.1 or behind a TLS proxy (see README).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TOKENIZERS_PARALLELISM=false

RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless nginx curl \
    && rm -rf /var/lib/apt/lists/*

# Runtime dependencies of the handler only (the pinned versions of requirements.txt).
COPY requirements-serve.txt /tmp/requirements-serve.txt
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install -r /tmp/requirements-serve.txt \
    && rm /tmp/requirements-serve.txt

RUN useradd --create-home --uid 10001 serve
WORKDIR /home/serve
COPY --chown=serve:serve serving/config.properties serving/log4j2.xml serving/nginx.conf /home/serve/
COPY --chown=serve:serve model_store/sentiment.mar /home/serve/model_store/sentiment.mar
# The health probe and the client it uses (standard library only).
COPY --chown=serve:serve serving/__init__.py serving/client.py serving/health.py /home/serve/serving/
# Inside the container inference moves to 127.0.0.1:8079 behind nginx; metrics bind to all interfaces.
RUN sed -i 's#^inference_address=.*#inference_address=http://127.0.0.1:8079#; s#^metrics_address=http://127.0.0.1:#metrics_address=http://0.0.0.0:#; s#^model_store=.*#model_store=/home/serve/model_store#' \
        /home/serve/config.properties
USER serve

EXPOSE 8080 8082
# Token authorization is on, /ping included: the probe reads the inference key TorchServe wrote in the working
# directory and asks the token API for a new one when it expired (serving/health.py).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD python -m serving.health --url http://127.0.0.1:8079 --key-file key_file.json || exit 1

CMD ["sh", "-c", "nginx -c /home/serve/nginx.conf && exec torchserve --start --foreground --ncs --ts-config /home/serve/config.properties --model-store /home/serve/model_store --log-config /home/serve/log4j2.xml"]
