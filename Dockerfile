# mcp-tasks-proxy: build a wheel, install it into a slim runtime image, run as a non-root user.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/mcp-tasks-proxy --create-home mcp-proxy
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 10001
WORKDIR /var/lib/mcp-tasks-proxy
VOLUME ["/var/lib/mcp-tasks-proxy"]
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)" || exit 1
ENTRYPOINT ["mcp-tasks-proxy"]
CMD ["--host", "0.0.0.0", "--port", "8080"]
