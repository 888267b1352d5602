"""sentiment-pipeline: IMDB -> finetuned, quantized, exported, served sentiment classifier."""

__version__ = "0.1.0"
