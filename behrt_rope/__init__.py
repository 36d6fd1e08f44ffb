"""behrt-rope: BEHRT with rotary position embedding, from EHR visit histories to diagnosis-risk predictions."""

__version__ = "0.1.0"
