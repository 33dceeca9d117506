"""Chat: a conversation turned into a prompt and a reply read back, the same way for every API.

- :mod:`mlxr_core.chat.prompt`: render the model's chat template, put each image's tokens at its
  marker, check the length and tokenize (BOS added where the template writes none), the one path
  every API, rerank and ``mlxr generate`` take;
- :mod:`mlxr_core.chat.tools`: tools and forced tool choices in the prompt, the parsers a model
  was given when it loaded, and the reader of one reply;
- :mod:`mlxr_core.chat.parsing`: the parser contracts (tool calls, reasoning, channels) that parser
  plugins implement, and the pieces a reply is split into.

The template itself is rendered by the model's tokenizer, in a sandbox with a deadline
(:mod:`mlxr_core.model.chat_template`).
"""
