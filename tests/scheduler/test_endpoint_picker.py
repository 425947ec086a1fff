"""The scheduler's Inference Extension endpoint picker, asked the way Envoy asks it: an ext_proc
``Process`` stream (the xds-protos stub) to a real scheduler process on loopback, with engines
registered through the scheduler's own gRPC."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from cryptography import x509
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .support import free_port, instance

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

GATEWAY_PORT = 8123
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


MODE = processing_mode_pb2.ProcessingMode


def _headers(end_of_stream: bool, mode: int = MODE.BUFFERED, response_mode: int = MODE.NONE) -> pb.ProcessingRequest:
    """The first message of a stream: the request headers and the proxy's body modes."""
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
              ((":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json"))]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end_of_stream),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=response_mode),
    )


def _body(data: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def picker_channel(port: int) -> grpc.Channel:
    """A channel to the picker as a proxy opens it by default: TLS, no client certificate. The
    picker's self-signed certificate (no key pair configured) is taken from the handshake and
    pinned, as a proxy that skips verification would accept it."""
    pem = ssl.get_server_certificate(("127.0.0.1", port))
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", "localhost")])


def ask(port: int, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    """One HTTP request through the picker, as a proxy sends it; the picker's answers."""
    with picker_channel(port) as channel:
        return list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))


def destination(response: pb.ProcessingResponse, phase: str) -> tuple[str, str]:
    """The endpoint a response names in its header mutation and in the envoy.lb metadata."""
    common = getattr(response, phase).response
    (header,) = common.header_mutation.set_headers
    assert header.header.key == "x-gateway-destination-endpoint"
    metadata = json_format.MessageToDict(response.dynamic_metadata)
    return header.header.raw_value.decode(), metadata["envoy.lb"]["x-gateway-destination-endpoint"]


def refusal(response: pb.ProcessingResponse) -> tuple[int, dict[str, str], dict]:
    immediate = response.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, headers, json.loads(immediate.body)["error"]


@pytest.fixture
def picker(start_scheduler) -> Iterator[tuple[object, int]]:
    port = free_port()
    sched = start_scheduler(no_instance_retry_after_s=3, endpoint_picker={
        "enabled": True, "port": port, "gateways": f"127.0.0.1:{GATEWAY_PORT}"})
    yield sched, port


@pytest.mark.slow
def test_routes_a_chat_request_to_a_gateway_pod_once_engines_serve_its_model(picker) -> None:
    sched, port = picker
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    first, second = ask(port, _headers(end_of_stream=False), _body(json.dumps(CHAT).encode()))
    assert first.WhichOneof("response") == "request_headers"  # buffered: headers continue, body decides
    assert not first.request_headers.response.header_mutation.set_headers
    assert destination(second, "request_body") == (f"127.0.0.1:{GATEWAY_PORT}",) * 2


@pytest.mark.slow
def test_full_duplex_answers_headers_after_the_body_and_hands_the_body_back(picker) -> None:
    sched, port = picker
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    body = json.dumps(CHAT).encode()
    mode = MODE.FULL_DUPLEX_STREAMED
    headers, returned = ask(port, _headers(False, mode), _body(body[:10], False), _body(body[10:], True))
    assert destination(headers, "request_headers")[0] == f"127.0.0.1:{GATEWAY_PORT}"
    streamed = returned.request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream


def _streamed_body(answers: list[pb.ProcessingResponse], phase: str) -> tuple[bytes, list[bool]]:
    """The body a proxy forwards from full-duplex answers: each chunk's bytes, and its end_of_stream."""
    chunks = [getattr(a, phase).response.body_mutation.streamed_response for a in answers if a.WhichOneof("response") == phase]
    assert all(len(c.body) <= 64 * 1024 for c in chunks)  # the protocol's recommended ceiling
    return b"".join(c.body for c in chunks), [c.end_of_stream for c in chunks]


def _servable(sched) -> None:
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))


@pytest.mark.slow
def test_full_duplex_hands_a_large_body_back_in_chunks_in_order_after_the_route(picker) -> None:
    sched, port = picker
    _servable(sched)
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}]}).encode()
    pieces = [body[i:i + 16_384] for i in range(0, len(body), 16_384)]  # as the proxy's buffers arrive
    messages = [_headers(False, MODE.FULL_DUPLEX_STREAMED)] + [_body(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    answers = ask(port, *messages)
    assert answers[0].WhichOneof("response") == "request_headers"  # headers, then body: the protocol's order
    assert destination(answers[0], "request_headers")[0] == f"127.0.0.1:{GATEWAY_PORT}"
    returned, ends = _streamed_body(answers, "request_body")
    assert returned == body and ends == [False] * (len(ends) - 1) + [True] and len(ends) == 4


@pytest.mark.slow
def test_full_duplex_with_trailers_routes_when_they_arrive_and_answers_them_last(picker) -> None:
    """With trailers the last body chunk has no end_of_stream; the trailers say the body is whole."""
    sched, port = picker
    _servable(sched)
    body = json.dumps(CHAT).encode()
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=base_pb2.HeaderMap()))
    answers = ask(port, _headers(False, MODE.FULL_DUPLEX_STREAMED), _body(body[:7], False), _body(body[7:], False), trailers)
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body", "request_trailers"]
    assert destination(answers[0], "request_headers")[0] == f"127.0.0.1:{GATEWAY_PORT}"
    assert _streamed_body(answers, "request_body") == (body, [False])  # trailers follow: not the end


@pytest.mark.slow
def test_full_duplex_response_bodies_are_handed_back_chunk_for_chunk(picker) -> None:
    """The response path in FULL_DUPLEX_STREAMED mode: an empty answer would empty the client's body."""
    sched, port = picker
    _servable(sched)
    first = _headers(False, MODE.FULL_DUPLEX_STREAMED, response_mode=MODE.FULL_DUPLEX_STREAMED)
    response = [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap())),
                pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {\"a\": 1}\n\n")),
                pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x" * 70_000)),
                pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))]
    answers = ask(port, first, _body(json.dumps(CHAT).encode(), True), *response)
    assert [a.WhichOneof("response") for a in answers][:3] == ["request_headers", "request_body", "response_headers"]
    returned, ends = _streamed_body(answers, "response_body")
    assert returned == b"data: {\"a\": 1}\n\n" + b"x" * 70_000 + b"data: [DONE]\n\n"
    assert ends[-1] and not any(ends[:-1])
    buffered = ask(port, _headers(False), _body(json.dumps(CHAT).encode()), response[0], response[3])
    assert not buffered[-1].response_body.response.HasField("body_mutation")  # other modes: left as it is


@pytest.mark.slow
def test_a_partial_buffer_cut_short_is_routed_unjudged_and_a_whole_one_judged(picker) -> None:
    """BUFFERED_PARTIAL sends at most the proxy's buffer: without end_of_stream the body may be
    cut, so it is not refused as bad JSON; with it, it is the whole body and is checked."""
    sched, port = picker
    _servable(sched)
    cut = json.dumps(CHAT).encode()[:20]
    answers = ask(port, _headers(False, MODE.BUFFERED_PARTIAL), _body(cut, False))
    assert destination(answers[1], "request_body")[0] == f"127.0.0.1:{GATEWAY_PORT}"
    answers = ask(port, _headers(False, MODE.BUFFERED_PARTIAL), _body(cut, True))
    assert refusal(answers[1])[2]["code"] == "invalid_json"


@pytest.mark.slow
def test_streamed_and_no_body_modes_route_on_the_headers(picker) -> None:
    """STREAMED: the proxy routes on the header answer before any body arrives; NONE: no body comes."""
    sched, port = picker
    _servable(sched)
    body = json.dumps(CHAT).encode()
    answers = ask(port, _headers(False, MODE.STREAMED), _body(body[:5], False), _body(body[5:], True))
    assert destination(answers[0], "request_headers")[0] == f"127.0.0.1:{GATEWAY_PORT}"
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body", "request_body"]
    assert not any(a.request_body.response.HasField("body_mutation") for a in answers[1:])  # passed on as sent
    (only,) = ask(port, _headers(False, MODE.NONE))
    assert destination(only, "request_headers")[0] == f"127.0.0.1:{GATEWAY_PORT}"


@pytest.mark.slow
def test_a_request_without_a_body_is_routed_on_its_headers(picker) -> None:
    _, port = picker
    (only,) = ask(port, _headers(end_of_stream=True))  # e.g. GET /v1/models: no engine needed
    assert destination(only, "request_headers")[0] == f"127.0.0.1:{GATEWAY_PORT}"


BAD_BODIES = [
    (b"{not json", "invalid_json"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), "missing_model"),
    (json.dumps({"model": "m"}).encode(), "missing_prompt"),
    (json.dumps({**CHAT, "messages": []}).encode(), "invalid_messages"),
    (json.dumps({**CHAT, "max_tokens": -1}).encode(), "invalid_max_tokens"),
]


@pytest.mark.slow
def test_a_bad_body_is_answered_at_once_with_400_and_its_reason(picker) -> None:
    sched, port = picker
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))  # servable: only the body is wrong
    for body, code in BAD_BODIES:
        _, answer = ask(port, _headers(end_of_stream=False), _body(body))
        status, headers, error = refusal(answer)
        assert (status, error["code"], headers["x-crescent-refusal"]) == (400, code, code), body
        assert error["message"]


@pytest.mark.slow
def test_no_engine_for_the_model_is_a_503_naming_the_missing_role(picker) -> None:
    sched, port = picker
    _, answer = ask(port, _headers(False), _body(json.dumps(CHAT).encode()))
    status, headers, error = refusal(answer)
    assert (status, error["code"], headers["retry-after"]) == (503, "no_prefill_instance", "3")
    assert "'m'" in error["message"]
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d-other", "decode", model_id="other"))  # another model's decode does not count
    _, answer = ask(port, _headers(False), _body(json.dumps(CHAT).encode()))
    assert refusal(answer)[2]["code"] == "no_decode_instance"


def test_gateway_name_that_resolves_to_nothing_is_a_503_naming_it(start_scheduler) -> None:
    port = free_port()
    sched = start_scheduler(endpoint_picker={"enabled": True, "port": port, "gateways": "no-such-host.invalid:8000"})
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    _, answer = ask(port, _headers(False), _body(json.dumps(CHAT).encode()))
    status, _, error = refusal(answer)
    assert (status, error["code"]) == (503, "no_gateway_endpoint") and "no-such-host.invalid" in error["message"]


def test_with_internal_tls_the_picker_serves_the_schedulers_certificate_and_asks_for_no_client_one(
        start_scheduler, tmp_path) -> None:
    """What Gateway API proxies can dial: TLS, server-only. A proxy that checks the picker's
    certificate against the internal CA finds the scheduler's; none has to present one."""
    from tests.security.support import make_test_pki

    pki = make_test_pki(tmp_path / "pki")
    port = free_port()
    start_scheduler(tls=pki.server["scheduler"],
                    endpoint_picker={"enabled": True, "port": port, "gateways": f"127.0.0.1:{GATEWAY_PORT}"})
    messages = (_headers(False), _body(json.dumps(CHAT).encode()))
    with grpc.secure_channel(f"127.0.0.1:{port}", pki.no_client_cert().channel_credentials()) as channel:
        answers = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))
    assert refusal(answers[-1])[2]["code"] == "no_prefill_instance"  # the picker itself answered
    with grpc.secure_channel(f"127.0.0.1:{port}", pki.by_role["gateway"].channel_credentials()) as channel:
        answers = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))
    assert refusal(answers[-1])[2]["code"] == "no_prefill_instance"  # a certificate is not asked for, nor checked
    served = x509.load_pem_x509_certificate(ssl.get_server_certificate(("127.0.0.1", port)).encode())
    assert served == x509.load_pem_x509_certificate(Path(pki.server["scheduler"]["cert"]).read_bytes())
    with pytest.raises(grpc.RpcError) as plaintext:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_required_client_certificate_admits_only_the_proxy_role_and_health_any_verified_caller(
        start_scheduler, tmp_path) -> None:
    from tests.security.support import make_test_pki

    pki = make_test_pki(tmp_path / "pki")
    port = free_port()
    start_scheduler(tls=pki.server["scheduler"], endpoint_picker={
        "enabled": True, "port": port, "gateways": f"127.0.0.1:{GATEWAY_PORT}", "tls": {"client_certificate": "required"}})
    messages = (_headers(False), _body(json.dumps(CHAT).encode()))

    def channel_as(role: str) -> grpc.Channel:
        return grpc.secure_channel(f"127.0.0.1:{port}", pki.by_role[role].channel_credentials())

    with channel_as("proxy") as channel:
        answers = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))
    assert refusal(answers[-1])[2]["code"] == "no_prefill_instance"
    with channel_as("gateway") as channel, pytest.raises(grpc.RpcError) as refused:
        list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with channel_as("gateway") as channel:  # health: any caller the handshake verified
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    with grpc.secure_channel(f"127.0.0.1:{port}", pki.no_client_cert().channel_credentials()) as channel:
        with pytest.raises(grpc.RpcError) as anonymous:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake itself fails


@pytest.mark.slow
def test_the_health_service_answers_for_the_names_the_protocol_lists(picker) -> None:
    _, port = picker
    with picker_channel(port) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_plaintext_is_served_on_loopback_when_asked_and_contradictory_settings_are_refused(start_scheduler) -> None:
    from crescent.services.common.settings import SettingsError
    from crescent.services.scheduler.config import load_scheduler_settings

    port = free_port()
    start_scheduler(endpoint_picker={"enabled": True, "port": port, "gateways": f"127.0.0.1:{GATEWAY_PORT}",
                                     "tls": {"plaintext": True}})
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        (only,) = pb_grpc.ExternalProcessorStub(channel).Process(iter([_headers(True)]), timeout=10)
    assert destination(only, "request_headers")[0] == f"127.0.0.1:{GATEWAY_PORT}"
    base = {"enabled": True, "gateways": "gw:8000"}
    with pytest.raises(SettingsError, match="plaintext"):
        load_scheduler_settings(endpoint_picker={**base, "tls": {"plaintext": True, "client_certificate": "required"}})
    with pytest.raises(SettingsError, match="client_ca"):
        load_scheduler_settings(endpoint_picker={**base, "tls": {"client_certificate": "required"}})
    with pytest.raises(SettingsError, match="client_certificate.*'none' or 'required'"):  # grpcio cannot ask for one without requiring it
        load_scheduler_settings(endpoint_picker={**base, "tls": {"client_certificate": "optional"}})


def test_requests_go_to_the_gateway_with_the_fewest_in_flight(start_scheduler) -> None:
    """A proxy keeps a request's ext_proc stream open until its response ends, so an open stream
    is a request in flight at the gateway it was routed to."""
    port = free_port()
    sched = start_scheduler(endpoint_picker={"enabled": True, "port": port,
                                             "gateways": f"127.0.0.1:{GATEWAY_PORT},127.0.0.2:{GATEWAY_PORT}"})
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    first_gw, second_gw = f"127.0.0.1:{GATEWAY_PORT}", f"127.0.0.2:{GATEWAY_PORT}"
    body = json.dumps(CHAT).encode()
    with picker_channel(port) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        release = threading.Event()

        def held() -> Iterator[pb.ProcessingRequest]:
            yield _headers(False)
            yield _body(body)
            release.wait(10)  # the response is still streaming: the stream stays open

        long_running = stub.Process(held(), timeout=15)
        next(long_running)
        assert destination(next(long_running), "request_body")[0] == first_gw  # a tie: the first
        assert destination(ask(port, _headers(False), _body(body))[1], "request_body")[0] == second_gw
        release.set()
        assert list(long_running) == []
    assert destination(ask(port, _headers(False), _body(body))[1], "request_body")[0] == first_gw


def _hinted(subset: list[object] | str, *messages: pb.ProcessingRequest) -> list[pb.ProcessingRequest]:
    """The messages with the proxy's subset hint (filter metadata) on the first one."""
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": subset})
    first = pb.ProcessingRequest()
    first.CopyFrom(messages[0])
    first.metadata_context.CopyFrom(base_pb2.Metadata(filter_metadata={"envoy.lb.subset_hint": hint}))
    return [first, *messages[1:]]


def test_a_proxys_subset_hint_limits_the_pick_and_an_empty_one_is_a_503(start_scheduler) -> None:
    port = free_port()
    first_gw, second_gw = f"127.0.0.1:{GATEWAY_PORT}", f"127.0.0.2:{GATEWAY_PORT}"
    sched = start_scheduler(no_instance_retry_after_s=2, endpoint_picker={
        "enabled": True, "port": port, "gateways": f"{first_gw},{second_gw}"})
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    body = json.dumps(CHAT).encode()
    # Without a hint the tie goes to the first gateway; the hint allows only the second.
    assert destination(ask(port, _headers(False), _body(body))[1], "request_body")[0] == first_gw
    answers = ask(port, *_hinted([second_gw], _headers(False), _body(body)))
    assert destination(answers[1], "request_body") == (second_gw, second_gw)
    # A member the picker's own lookup has not seen yet is still the proxy's to allow.
    fresh = f"127.0.0.3:{GATEWAY_PORT}"
    assert destination(ask(port, *_hinted([fresh], _headers(True)))[0], "request_headers")[0] == fresh
    status, headers, error = refusal(ask(port, *_hinted([], _headers(False), _body(body)))[-1])
    assert (status, error["code"], headers["retry-after"]) == (503, "empty_endpoint_subset", "2")
    assert refusal(ask(port, *_hinted("not a list", _headers(False), _body(body)))[-1])[0] == 503

    metrics = sched.metrics()
    assert 'crescent_endpoint_picker_decisions_total{outcome="routed"} 3.0' in metrics
    assert 'crescent_endpoint_picker_decisions_total{outcome="empty_endpoint_subset"} 2.0' in metrics
    assert f'crescent_endpoint_picker_in_flight{{endpoint="{second_gw}"}} 0.0' in metrics  # its stream ended
    assert "crescent_endpoint_picker_pick_seconds_count 5.0" in metrics
