"""A byte-level tokenizer built in code, for the tiny models: no vocabulary file, no download.

Token ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, then one id per byte (3..258). A real model brings
its own tokenizer from its weights directory instead.
"""

from typing import Any

VOCAB_SIZE = 259


def byte_tokenizer(max_length: int, bos: bool) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` that maps each UTF-8 byte to a token, pads with
    ``<pad>`` to ``max_length`` and ends with ``</s>`` (after a leading ``<s>`` when ``bos``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i, ch in enumerate(sorted(alphabet)):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    single = "<s> $A </s>" if bos else "$A </s>"
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=max_length)
