"""llama.cpp, the second engine's machinery: the pinned build (build.py), GGUF files made with llama.cpp's own
converter (gguf.py) and a llama-server client (server.py). The engine itself is flashdraft.engines.llamacpp.

`make llamacpp` builds the llama.cpp that the pinned `llama-cpp-python` sdist vendors into
$FLASHDRAFT_LLAMACPP (default: the flashdraft cache, llamacpp/VERSION): bin/ holds the tools, src/ the source tree
with convert_hf_to_gguf.py.
"""
