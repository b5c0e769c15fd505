"""The output format, defined once: its name and version, the manifest's file name, and the
files copied beside the rank directories.

Every writer (repack in each layout, the vLLM plugin's reader, verify) takes these names from
here, so an output written by one is recognised by the others.
"""

from __future__ import annotations

MANIFEST_NAME = "wna16ctl.json"
FORMAT_NAME = "wna16ctl-repack"
FORMAT_VERSION = 1

# The checkpoint's files copied beside the rank directories as they are (the model's config, the
# tokenizer, generation and chat-template files): what an engine reads from the output directory
# besides the weights.
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "added_tokens.json", "preprocessor_config.json",
)
