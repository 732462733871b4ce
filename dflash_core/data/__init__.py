"""Record schemas shared between pipeline stages (generation writes them, tokenization reads them)."""
