"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: OpenAI's speech to text.

A multipart form: ``file`` (the audio, at most ``server.max_audio_bytes``), ``model``,
``language`` (transcriptions only), ``prompt``, ``response_format`` (``json``, ``text``, ``srt``,
``vtt``, ``verbose_json``), ``temperature`` and ``timestamp_granularities[]`` (``segment``,
``word``: with ``verbose_json``, the reply's ``segments`` and ``words``; ``word`` with another
format is refused, as OpenAI refuses it). The file is decoded and its features computed in a worker thread
(:mod:`mlxr_core.http.audio`, the model's front end), then transcribed on the engine thread
(:meth:`~mlxr_core.engine.client.EngineClient.transcribe_async`), a decoder step at a time between
the engine's batch steps. Replies are whole (OpenAI streams only its gpt-4o models' transcripts).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import anyio
import attrs
from litestar import Request, Response, post
from litestar.datastructures import UploadFile
from msgspec import Meta, Struct, field

from mlxr_core.engine.admission import ModelInfo
from mlxr_core.errors import Overloaded, RequestError
from mlxr_core.http.audio import AudioLimits, decode_audio
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import json_response, loaded_model, ready_engine, unless_disconnected
from mlxr_core.http.openapi import documented
from mlxr_core.model.audio import AudioFrontEnd, Transcript, TranscriptionOptions
from mlxr_plugins.apis.openai import schemas as s

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
#: Whisper's language codes and the names OpenAI reports for them in ``verbose_json``'s
#: ``language`` (``_`` for a space).
LANGUAGE_TABLE = (
    "en=english zh=chinese de=german es=spanish ru=russian ko=korean fr=french ja=japanese "
    "pt=portuguese tr=turkish pl=polish ca=catalan nl=dutch ar=arabic sv=swedish it=italian "
    "id=indonesian hi=hindi fi=finnish vi=vietnamese he=hebrew uk=ukrainian el=greek ms=malay "
    "cs=czech ro=romanian da=danish hu=hungarian ta=tamil no=norwegian th=thai ur=urdu hr=croatian "
    "bg=bulgarian lt=lithuanian la=latin mi=maori ml=malayalam cy=welsh sk=slovak te=telugu "
    "fa=persian lv=latvian bn=bengali sr=serbian az=azerbaijani sl=slovenian kn=kannada et=estonian "
    "mk=macedonian br=breton eu=basque is=icelandic hy=armenian ne=nepali mn=mongolian bs=bosnian "
    "kk=kazakh sq=albanian sw=swahili gl=galician mr=marathi pa=punjabi si=sinhala km=khmer sn=shona "
    "yo=yoruba so=somali af=afrikaans oc=occitan ka=georgian be=belarusian tg=tajik sd=sindhi "
    "gu=gujarati am=amharic yi=yiddish lo=lao uz=uzbek fo=faroese ht=haitian_creole ps=pashto "
    "tk=turkmen nn=nynorsk mt=maltese sa=sanskrit lb=luxembourgish my=myanmar bo=tibetan tl=tagalog "
    "mg=malagasy as=assamese tt=tatar haw=hawaiian ln=lingala ha=hausa ba=bashkir jw=javanese "
    "su=sundanese yue=cantonese "
)
LANGUAGE_NAMES = {code: name.replace("_", " ") for code, name in (pair.split("=") for pair in LANGUAGE_TABLE.split())}
#: What the multipart form may hold besides the file, as the document states it.
FORM_BYTES = 1 << 20


class TranscriptionForm(Struct, kw_only=True):
    """The form's fields (``file`` is binary; the document says so)."""

    file: str
    model: s.ModelName
    language: str = ""
    prompt: str = ""
    response_format: Literal["json", "text", "srt", "vtt", "verbose_json"] = "json"
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    #: ``segment`` and/or ``word`` (``verbose_json`` only), once per value.
    timestamp_granularities: list[Literal["segment", "word"]] = field(default_factory=list, name="timestamp_granularities[]")


class TranscriptionSegment(Struct):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptionWord(Struct):
    word: str
    start: float
    end: float


class TranscriptionUsage(Struct):
    type: str
    seconds: float


class Transcription(Struct, omit_defaults=True):
    """``json``'s reply (``text``, ``usage``), and ``verbose_json``'s with the rest set."""

    text: str
    usage: TranscriptionUsage | None = None
    task: str | None = None
    language: str | None = None
    duration: float | None = None
    segments: list[TranscriptionSegment] | None = None
    words: list[TranscriptionWord] | None = None


#: Characters of the ``prompt`` field (OpenAI documents it for a few sentences; Whisper's decoder
#: reads the last half of its 448 positions of it at most): tokenized on the event loop, so bounded.
MAX_PROMPT_CHARS = 4096

def audio_routes(ctx: ServerContext, paths: Any) -> list[Any]:
    """The two routes, each under ``/v1`` and bare (``paths``)."""
    limit = ctx.config.server.max_audio_bytes + FORM_BYTES
    operation = documented(
        error=s.ErrorBody, form=TranscriptionForm, response=Transcription, text=True
    )

    @post(paths("/audio/transcriptions"), status_code=200, request_max_body_size=limit, operation_class=operation)
    async def transcriptions(request: Request[Any, Any, Any]) -> Response[Any]:
        return await transcribe(ctx, request, "transcribe")

    @post(paths("/audio/translations"), status_code=200, request_max_body_size=limit, operation_class=operation)
    async def translations(request: Request[Any, Any, Any]) -> Response[Any]:
        return await transcribe(ctx, request, "translate")

    return [transcriptions, translations]


async def transcribe(ctx: ServerContext, request: Request[Any, Any, Any], task: str) -> Response[Any]:
    """Read the form, decode the file, transcribe, answer in the asked format."""
    form = await request.form()
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise RequestError("the form needs the audio as a file part named 'file'", field="file")
    model = _text(form, "model")
    if not model:
        raise RequestError("the form needs the model's name", field="model")
    response_format = _text(form, "response_format") or "json"
    if response_format not in FORMATS:
        raise RequestError(f"response_format must be one of {', '.join(FORMATS)}", field="response_format")
    language = _text(form, "language") if task == "transcribe" else None
    granularities = [str(value) for key in ("timestamp_granularities[]", "timestamp_granularities")
                     for value in form.getall(key, [])]  # fmt: skip
    for granularity in granularities:
        if granularity not in ("segment", "word"):
            raise RequestError("timestamp_granularities holds segment or word", field="timestamp_granularities")
    words = "word" in granularities
    if words and response_format != "verbose_json":
        raise RequestError("word timestamps come with response_format verbose_json only", field="timestamp_granularities")
    temperature = _number(_text(form, "temperature"), "temperature")
    prompt_text = (_text(form, "prompt") or "").strip()
    if len(prompt_text) > MAX_PROMPT_CHARS:  # the decoder reads the last 224 of its tokens at most
        raise RequestError(f"prompt holds at most {MAX_PROMPT_CHARS} characters", field="prompt")
    ready_engine(ctx)
    info = await loaded_model(ctx, model)
    front_end = info.audio_front_end
    if front_end is None:
        raise RequestError(f"the model {info.name!r} does not transcribe audio (it is no speech model)", field="model")
    options = TranscriptionOptions(
        task=task, language=language.lower() if language else None, temperature=temperature,
        timestamps=response_format in ("srt", "vtt", "verbose_json"), words=words,
    )  # fmt: skip
    slots = ctx.transcriptions
    try:
        slots.acquire_nowait()
    except anyio.WouldBlock:
        raise Overloaded(
            f"{int(slots.total_tokens)} transcriptions are running (engine.max_transcriptions); retry later"
        ) from None
    try:
        transcript = await _transcribe(ctx, request, info, front_end, upload, prompt_text, options)
    finally:
        slots.release()
    # verbose_json holds the segments unless only words were asked for (OpenAI's reply).
    return reply(transcript, response_format, task, segments=not words or "segment" in granularities, words=words)


async def _transcribe(
    ctx: ServerContext, request: Request[Any, Any, Any], info: ModelInfo, front_end: AudioFrontEnd,
    upload: UploadFile, prompt_text: str, options: TranscriptionOptions,
) -> Transcript:  # fmt: skip
    """Decode ``upload``, compute its features and transcribe them on the engine thread."""
    raw = await upload.read()
    limits = AudioLimits.from_server(ctx.config.server)
    audio = await anyio.to_thread.run_sync(functools.partial(decode_audio, raw, limits, sample_rate=front_end.sample_rate))
    features = await anyio.to_thread.run_sync(front_end, audio.samples)
    prompt = info.tokenizer.encode(" " + prompt_text, add_special_tokens=False) if prompt_text else []
    options = attrs.evolve(options, prompt=tuple(prompt))
    engine = ready_engine(ctx)
    return await unless_disconnected(request, engine.transcribe_async(info.name, features, audio.seconds, options))


def reply(
    transcript: Transcript, response_format: str, task: str, *, segments: bool = True, words: bool = False
) -> Response[Any]:
    """The reply in ``response_format``; ``verbose_json`` holds the ``segments`` and/or the
    ``words`` as asked (a word is its text without the space before it; one of only spaces is left out)."""
    usage = TranscriptionUsage("duration", round(transcript.duration, 3))
    if response_format == "json":
        return json_response(Transcription(transcript.text, usage))
    if response_format == "verbose_json":
        listed = [
            TranscriptionSegment(
                id=seg.id, seek=seg.seek, start=seg.start, end=seg.end, text=seg.text, tokens=list(seg.tokens),
                temperature=seg.temperature, avg_logprob=seg.avg_logprob, compression_ratio=seg.compression_ratio,
                no_speech_prob=seg.no_speech_prob,
            )
            for seg in transcript.segments
        ]
        timed = [TranscriptionWord(word.word.strip(), word.start, word.end) for word in transcript.words if word.word.strip()]
        return json_response(Transcription(
            transcript.text, usage, task="translate" if task == "translate" else "transcribe",
            language=LANGUAGE_NAMES.get(transcript.language, transcript.language), duration=round(transcript.duration, 3),
            segments=listed if segments else None, words=timed if words else None,
        ))  # fmt: skip
    if response_format == "text":
        return Response(transcript.text + "\n", media_type="text/plain; charset=utf-8")
    return Response(subtitles(transcript, vtt=response_format == "vtt"), media_type="text/plain; charset=utf-8")


def subtitles(transcript: Transcript, *, vtt: bool) -> str:
    """SubRip (numbered cues, ``00:00:01,000``) or WebVTT (a ``WEBVTT`` header, ``00:00:01.000``)."""
    mark = "." if vtt else ","
    cues = []
    for index, segment in enumerate(transcript.segments, start=1):
        span = f"{clock(segment.start, mark)} --> {clock(segment.end, mark)}"
        text = segment.text.strip()
        cues.append(f"{span}\n{text}\n" if vtt else f"{index}\n{span}\n{text}\n")
    return ("WEBVTT\n\n" if vtt else "") + "\n".join(cues)


def clock(seconds: float, mark: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    return f"{hours:02d}:{minutes:02d}:{millis // 1000:02d}{mark}{millis % 1000:03d}"


def _text(form: Any, key: str) -> str | None:
    value = form.get(key)
    if value is None:
        return None
    if isinstance(value, UploadFile):
        raise RequestError(f"{key} must be a text field, not a file", field=key)
    return str(value)


def _number(value: str | None, field: str) -> float:
    if value is None or value == "":
        return 0.0
    try:
        number = float(value)
    except ValueError:
        raise RequestError(f"{field} must be a number", field=field) from None
    if not 0.0 <= number <= 1.0:
        raise RequestError(f"{field} must lie in [0, 1]", field=field)
    return number
