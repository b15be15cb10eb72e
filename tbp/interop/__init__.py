"""Other tools' formats: Hugging Face GPT-2 folders (``hf``) and llama.cpp's GGUF files (``gguf``)."""
