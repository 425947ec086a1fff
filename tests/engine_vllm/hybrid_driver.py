"""Run by the hybrid vLLM tests with the vLLM venv's interpreter: one fresh vLLM engine (its own
engine-core and worker processes) on a hybrid checkpoint, with Crescent's KV connector pointed at
a kvstore (or, with an empty address, plain vLLM: the standalone reference), running greedy
requests one after another and printing, as one JSON line, each one's output tokens and vLLM's
count of prompt tokens it did not compute.

    python hybrid_driver.py MODEL_DIR KVSTORE_ADDRESS BLOCK_SIZE JOBS_JSON
    JOBS_JSON: [{"prompt": [ids...], "tenant": "acme", "max_tokens": 8, "ignore_eos": false}, ...]
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    model_dir, kvstore, block_size, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from crescent.services.engine_vllm.connector_options import ConnectorOptions, tenant_salt
    from crescent.services.engine_vllm.engine import CONNECTOR_MODULE

    connector = None
    if kvstore:
        options = ConnectorOptions(model_id="tiny-hybrid", block_size=block_size, kvstore_address=kvstore,
                                   kvstore_shared_memory=False)
        connector = KVTransferConfig(
            kv_connector="CrescentConnector", kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=options.to_extra_config())
    llm = LLM(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2048, block_size=block_size,
              enable_prefix_caching=True, enforce_eager=True, kv_transfer_config=connector)
    results = []
    for job in jobs:
        params = SamplingParams(max_tokens=job.get("max_tokens", 8), temperature=0, detokenize=False,
                                ignore_eos=job.get("ignore_eos", False))
        prompt = {"prompt_token_ids": job["prompt"]}
        if "tenant" in job:
            prompt["cache_salt"] = tenant_salt(job["tenant"].encode())
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0})
    time.sleep(3)  # the last step's saves are put in the background
    llm.llm_engine.engine_core.shutdown()  # engine core and worker exit (the connector flushes its puts)
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
