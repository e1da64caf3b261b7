"""Chat templates for the demo model, which ships none: a ChatML template with tools in
Qwen3's tool-call format (``<tool_call>{json}</tool_call>``, tool results as
``<tool_response>`` in a user turn), written for the tests; and a helper that makes a
copy of the demo model directory carrying it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from elasticep_testkit.paths import DEMO_MODEL

QWEN3_STYLE = """\
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

Functions you may call, one JSON signature a line:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

To call one, answer with its name and arguments as JSON inside tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


def demo_with_chat_template(dst: Path, template: str = QWEN3_STYLE) -> Path:
    """A copy of the demo model in ``dst`` (weights symlinked) whose tokenizer carries
    ``template``."""
    dst.mkdir(parents=True)
    for f in DEMO_MODEL.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst
