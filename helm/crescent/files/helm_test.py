# `helm test`: what a client of the gateway would see. Standard library only (runs in the image).
import json, os, sys, time, urllib.error, urllib.request

URL, MODEL, KEY = os.environ["CRESCENT_TEST_URL"], os.environ["CRESCENT_TEST_MODEL"], os.environ.get("CRESCENT_TEST_API_KEY", "")


def call(path, body=None, key=KEY):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(URL + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, None


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


for attempt in range(30):  # the gateway may still be becoming ready
    try:
        status, _ = call("/health", key="")
        break
    except OSError:
        time.sleep(2)
else:
    check(False, "GET /health: no answer from " + URL)
check(status == 200, "GET /health answers 200 (got %s)" % status)
if os.environ.get("CRESCENT_TEST_AUTH") == "1" and not KEY:
    status, _ = call("/v1/models", key="")
    check(status == 401, "GET /v1/models without a key is refused with 401 (got %s)" % status)
    print("no API key given (helmTest.apiKeySecret): models and chat not checked")
    sys.exit(0)
status, models = call("/v1/models")
check(status == 200, "GET /v1/models answers 200 (got %s)" % status)
ids = [m.get("id") for m in (models or {}).get("data", [])]
check(MODEL in ids, "GET /v1/models lists %s (got %s)" % (MODEL, ids))
if os.environ.get("CRESCENT_TEST_CHAT") == "1":
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}]}
    for attempt in range(60):  # 503 while no engine instance has registered yet
        status, answer = call("/v1/chat/completions", body)
        if status != 503:
            break
        time.sleep(2)
    check(status == 200, "POST /v1/chat/completions answers 200 (got %s)" % status)
    choice = ((answer or {}).get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    check(bool(text.strip()) and (answer.get("usage") or {}).get("completion_tokens", 0) > 0,
          "the chat completion has an answer (%r)" % text)
print("all checks passed")
