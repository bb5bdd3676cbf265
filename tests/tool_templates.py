"""Chat templates that render ``tools`` as three model families' templates do, small
enough for the tiny models' 512 positions (written for these tests, after the families'
own: the same variables, tool block and call syntax, fewer words).

* ``HERMES_TEMPLATE``: Hermes 2 Pro and Qwen 2.5's ChatML with the tools as JSON lines
  in ``<tools></tools>`` in the system turn, calls in ``<tool_call></tool_call>``, a
  tool's result as a user turn in ``<tool_response>``;
* ``LLAMA3_TEMPLATE``: Llama 3.1's headers, the tools as JSON in the system turn under
  "... in the format {"name": function name, "parameters": dictionary of argument name
  and its value}", results under the ``ipython`` role;
* ``MISTRAL_TEMPLATE``: Mistral v0.3's ``[AVAILABLE_TOOLS]`` before the last user turn,
  a past assistant call as ``[TOOL_CALLS]``, results as ``[TOOL_RESULTS]``.
"""

from __future__ import annotations

from tests.test_openai_sdk import CHATML as CHATML

HERMES_TOOL_BLOCK = "# Tools\n<tools>\n"

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    + HERMES_TOOL_BLOCK +
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "Call: <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (loop.first and m['role'] == 'system') %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TOOL_BLOCK = ('Call in the format {"name": function name, "parameters": dictionary '
                     'of argument name and its value}.')

LLAMA3_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython\n"
    + LLAMA3_TOOL_BLOCK + "\n\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{% endif %}"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}"
    "{% if loop.last and tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] is defined %}"
    "[TOOL_CALLS] {{ m['tool_calls'] | tojson }}</s>"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}</s>"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS] {{ m['content'] }}[/TOOL_RESULTS]"
    "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
    "{% endfor %}"
)
