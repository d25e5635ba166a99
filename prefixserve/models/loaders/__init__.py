"""Model files into decoders: the entry point (`load`), GGUF files (`gguf`, `hybrid_gguf`), Hugging
Face folders (`hf_folder`, `hybrid_folder`), HF-named tensors into a Llama-family decoder
(`llama_weights`) and the prepared-model cache (`prepared`)."""
