"""An image-only Qwen2.5-VL processor for the CPU smoke model: no video processor, so no torchvision.

transformers' ``Qwen2_5_VLProcessor`` requires a video processor, and every video processor requires
torchvision, which a CPU install of this project does not carry. The smoke model's directory names this class
as its remote-code processor (``auto_map``), so ``AutoProcessor.from_pretrained(..., trust_remote_code=True)``
(what verl's ``hf_processor`` calls in the data set, the agent loop and the workers) builds it. It keeps the
class name because verl binds ``get_rope_index`` by processor class name; everything else is transformers'
processor, with PIL image processing. A prompt with a video is refused.
"""

from __future__ import annotations

from typing import Any

from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor as _HFQwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin


class Qwen2_5_VLProcessor(_HFQwen2_5_VLProcessor):  # noqa: N801 - verl matches this exact class name
    """Qwen2.5-VL's processor with an image processor and a tokenizer only."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any) -> Any:
        """transformers' processing of text and images; videos are refused (no video processor here)."""
        if videos is not None:
            raise ValueError("the smoke model's image-only processor takes no videos")
        return super().__call__(images=images, text=text, **kwargs)


__all__ = ["Qwen2_5_VLProcessor"]
