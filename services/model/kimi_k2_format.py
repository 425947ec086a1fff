"""Kimi K2's chat format, as a Jinja template (Kimi K2, K2 Thinking, Kimi-Linear checkpoints).

``KIMI_CHAT_TEMPLATE`` follows K2's published one:

- ``<|im_system|>tool_declare<|im_middle|>[tools as compact JSON]<|im_end|>`` first, when tools are given;
- ``<|im_system|>system<|im_middle|>...<|im_end|>`` (a default system prompt if there is none),
  ``<|im_user|>user<|im_middle|>...<|im_end|>``, ``<|im_assistant|>assistant<|im_middle|>...<|im_end|>``;
- an assistant turn is ``<think>reasoning</think>`` + content + tool calls. Which turns keep
  their reasoning is the model family's *thinking history* (``THINKING_HISTORY``): ``"all"``
  (a family trained with preserved thinking) keeps every turn's; ``"current_turn"`` (K2-style) keeps
  it only for turns after the last user message (the current agentic loop), older turns carry an
  empty ``<think></think>`` as Kimi K2 Thinking renders them. The template variable
  ``preserve_thinking`` (a request's ``chat_template_kwargs``) overrides the family's choice;
- tool calls: ``<|tool_calls_section_begin|>`` then per call
  ``<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>`` then
  ``<|tool_calls_section_end|>``; ids have the native form ``functions.NAME:INDEX``;
- a tool result: ``<|im_system|>NAME<|im_middle|>## Return of ID\\nRESULT<|im_end|>``
  (NAME is the message's ``name``, else ``tool``);
- the reply starts after ``<|im_assistant|>assistant<|im_middle|>``; with ``thinking=False``
  (instant mode) the prompt also closes an empty ``<think></think>``, so the reply is the answer.
"""

from __future__ import annotations

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
END_OF_TURN = "<|im_end|>"

KIMI_CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set role = m['role'] -%}"
    "{%- if role == 'user' -%}<|im_user|>user<|im_middle|>{{ text(m['content']) }}"
    "{%- elif role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if (preserve_thinking or loop.index0 > ns.last_user) and m.get('reasoning_content') -%}"
    "<think>{{ m['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ text(m.get('content')) }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in m['tool_calls'] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{{ args if args is string else args | tojson }}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}"
    "{%- elif role == 'tool' -%}<|im_system|>{{ m.get('name') or 'tool' }}<|im_middle|>"
    "## Return of {{ m.get('tool_call_id') or '' }}\n{{ text(m['content']) }}"
    "{%- elif role == 'system' -%}<|im_system|>system<|im_middle|>{{ text(m['content']) }}"
    "{%- else -%}{{ raise_exception('unknown role ' + role) }}"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)
