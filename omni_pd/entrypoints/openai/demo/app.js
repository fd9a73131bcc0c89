// The voice demo: the microphone to /v1/realtime, the answer played as it streams, its
// transcript, barge-in, and time to first audio per turn.
//
// Two ways to talk. Hands-free: the microphone streams all the time and the server's VAD ends
// each turn and starts the answer; speaking over an answer stops it (the server cancels a running
// response itself; the page stops playing at once). Hold to talk: the server's VAD is off; the
// page commits the turn and asks for the answer on release, and a press during an answer cancels
// it (response.cancel). Either way an answer cut short is truncated in the conversation to what
// was played (conversation.item.truncate), as OpenAI's Realtime clients do.
//
// window.demo holds the page's state; window.demo.snapshot() is what the tests read.
import {Microphone, Player, PCM_RATE, base64ToFloat32, pcm16ToBase64, rms} from './audio.js';
import {RealtimeConnection, Refused, realtimeUrl} from './realtime.js';
import {View} from './view.js';

const CHUNK_MS = 40; // capture-worklet.js posts 960 samples at 24 kHz
const MIN_COMMIT_MS = 100; // the server refuses shorter commits
// Server VAD as the page sets it: aggressiveness 3 (threshold >= 0.75) hears less room noise.
const SERVER_VAD = {type: 'server_vad', threshold: 0.8, silence_duration_ms: 500, prefix_padding_ms: 300,
                    create_response: true, interrupt_response: true};

const demo = {
  status: 'loading', // loading, ready, connecting, connected, refused, closed, error
  message: 'Loading…',
  connects: 0, // Connect presses
  config: null,
  mode: 'vad',
  micOn: false,
  holding: false,
  level: 0,
  turns: [], // {n, speaking, userMs, sentMs, tooShort, endedAt, response}
  sentMs: 0, // audio sent in the session
  receivedSamples: 0,
  playedSamples: 0,
  serverErrors: [],
  pageErrors: [],
  eventCounts: {},
  snapshot() {
    return JSON.parse(JSON.stringify(this)); // plain data: the method itself is left out
  },
};
window.demo = demo;

const view = new View();
const form = document.getElementById('connect-form');
const inputs = {
  key: document.getElementById('api-key'), keyLabel: document.getElementById('key-label'),
  mode: document.getElementById('mode'), voice: document.getElementById('voice'),
  maxTokens: document.getElementById('max-tokens'), connect: document.getElementById('connect'),
  disconnect: document.getElementById('disconnect'), talk: document.getElementById('talk'),
};
let connection = null;
let player = null;
let mic = null;
const responses = new Map(); // response id -> the response object of its turn
const cancels = new Set(); // event ids of our response.cancel events

function show(status, message) {
  demo.status = status;
  demo.message = message;
  view.schedule(demo);
}

function fail(error) {
  console.error(error);
  demo.pageErrors.push(String(error && error.message || error));
  show('error', `Error: ${error && error.message || error}`);
}

window.addEventListener('error', (event) => demo.pageErrors.push(String(event.message)));
window.addEventListener('unhandledrejection', (event) => demo.pageErrors.push(String(event.reason)));

// ---- turns and responses -----------------------------------------------------------------
function newTurn() {
  const turn = {n: demo.turns.length + 1, speaking: true, userMs: null, sentMs: 0, tooShort: false,
                endedAt: null, response: null};
  demo.turns.push(turn);
  return turn;
}

function lastTurn() {
  return demo.turns[demo.turns.length - 1] || newTurn();
}

function startResponse(id) {
  let turn = lastTurn();
  if (turn.response) turn = newTurn(); // an answer without a new user turn
  turn.speaking = false;
  const response = {id, itemId: null, status: 'in_progress', reason: null, text: '', received: 0,
                    played: 0, ttfaMs: null, createdAt: performance.now(), interrupted: null,
                    playedFinal: false, truncateSent: false, truncatedMs: null, ended: false};
  turn.response = response;
  responses.set(id, {turn, response});
}

function audioDelta(event) {
  const entry = responses.get(event.response_id);
  if (!entry) return;
  const {turn, response} = entry;
  const samples = base64ToFloat32(event.delta);
  if (response.ttfaMs === null) response.ttfaMs = performance.now() - (turn.endedAt ?? response.createdAt);
  response.received += samples.length;
  demo.receivedSamples += samples.length;
  if (!response.interrupted) player.play(response.id, samples);
}

// The answer that is being spoken (or still made): the one a barge-in stops.
function speakingResponse() {
  for (let i = demo.turns.length - 1; i >= 0; i--) {
    const response = demo.turns[i].response;
    if (response && !response.interrupted && !response.ended &&
        (response.status === 'in_progress' || response.played < response.received)) return response;
  }
  return null;
}

function bargeIn(by) {
  const response = speakingResponse();
  if (!response) return;
  response.interrupted = by;
  // Hands-free, the server's VAD cancels the response itself (interrupt_response).
  if (by === 'press' && response.status === 'in_progress') {
    cancels.add(connection.send({type: 'response.cancel', response_id: response.id}));
  }
  player.clear(); // answered by a report with `cleared`, whose counts are final
  view.log(`barge-in (${by === 'speech' ? 'you spoke' : 'you pressed'}): playback stopped`);
}

// An interrupted answer stays in the conversation as far as it was played, once its response
// is over (the server refuses to truncate a running one).
function truncateIfCut(response) {
  if (!response.interrupted || !response.playedFinal || response.status === 'in_progress' ||
      response.truncateSent || !response.itemId || response.played >= response.received) return;
  response.truncateSent = true;
  connection.send({type: 'conversation.item.truncate', item_id: response.itemId, content_index: 0,
                   audio_end_ms: Math.floor(response.played * 1000 / PCM_RATE)});
}

function onPlayed(report) {
  for (const [id, played] of Object.entries(report.counts)) {
    const entry = responses.get(id);
    if (entry) entry.response.played = played;
  }
  demo.playedSamples = demo.turns.reduce((sum, turn) => sum + (turn.response ? turn.response.played : 0), 0);
  if (report.cleared) {
    for (const {response} of responses.values()) {
      if (response.interrupted && !response.playedFinal) {
        response.playedFinal = true;
        truncateIfCut(response);
      }
    }
  }
  view.schedule(demo);
}

// ---- server events ----------------------------------------------------------------------
function onEvent(event) {
  demo.eventCounts[event.type] = (demo.eventCounts[event.type] || 0) + 1;
  const entry = event.response_id ? responses.get(event.response_id) : null;
  switch (event.type) {
    case 'input_audio_buffer.speech_started': {
      const turn = newTurn();
      turn.startMs = event.audio_start_ms;
      bargeIn('speech');
      break;
    }
    case 'input_audio_buffer.speech_stopped': {
      const turn = lastTurn();
      turn.speaking = false;
      turn.userMs = event.audio_end_ms - (turn.startMs ?? event.audio_end_ms);
      turn.endedAt = performance.now();
      break;
    }
    case 'response.created':
      startResponse(event.response.id);
      break;
    case 'response.output_item.added':
      if (entry) entry.response.itemId = event.item.id;
      break;
    case 'response.output_audio.delta':
      audioDelta(event);
      break;
    case 'response.output_audio_transcript.delta':
    case 'response.output_text.delta':
      if (entry) entry.response.text += event.delta;
      break;
    case 'response.done': {
      const done = responses.get(event.response.id);
      if (!done) break;
      done.response.status = event.response.status;
      done.response.reason = event.response.status_details && event.response.status_details.reason;
      view.log(`answer ${event.response.status}${done.response.reason ? ` (${done.response.reason})` : ''}`);
      truncateIfCut(done.response);
      break;
    }
    case 'conversation.item.truncated':
      for (const {response} of responses.values()) {
        if (response.itemId === event.item_id) response.truncatedMs = event.audio_end_ms;
      }
      break;
    case 'error':
      onServerError(event.error);
      break;
    default:
      break;
  }
  view.schedule(demo);
}

function onServerError(error) {
  // A cancel that crossed the answer's end on the wire: nothing was left to cancel.
  if (error.code === 'response_cancel_not_active' && cancels.has(error.event_id)) {
    view.log('the answer had already finished');
    return;
  }
  demo.serverErrors.push(error);
  view.log(`server error: ${error.message}`);
  console.warn('omni-pd server error', error);
}

function onClose(close) {
  teardown();
  show('closed', `Disconnected by the server (code ${close.code}${close.reason ? ': ' + close.reason : ''}).`);
}

// ---- the microphone -------------------------------------------------------------------------
function onChunk(samples) {
  demo.level = Math.min(1, rms(samples) * 4);
  const sending = connection && (demo.mode === 'vad' ? demo.micOn : demo.holding);
  if (sending) {
    connection.send({type: 'input_audio_buffer.append', audio: pcm16ToBase64(samples)});
    demo.sentMs += CHUNK_MS;
    if (demo.mode === 'hold') lastTurn().sentMs += CHUNK_MS;
  }
  view.schedule(demo);
}

async function toggleMic() {
  if (demo.micOn) {
    demo.micOn = false;
    await closeMic();
    connection.send({type: 'input_audio_buffer.clear'});
    inputs.talk.textContent = 'Start talking';
    show('connected', 'Connected. Press “Start talking”.');
    return;
  }
  mic = await Microphone.open(onChunk);
  demo.micOn = true;
  inputs.talk.textContent = 'Stop talking';
  show('connected', 'Listening: speak; speak again over an answer to interrupt it.');
}

async function press() {
  if (demo.holding || !connection) return;
  demo.holding = true;
  bargeIn('press');
  connection.send({type: 'input_audio_buffer.clear'});
  newTurn();
  show('connected', 'Recording… release to send.');
  if (!mic) mic = await Microphone.open(onChunk);
}

function release() {
  if (!demo.holding) return;
  demo.holding = false;
  const turn = lastTurn();
  turn.speaking = false;
  turn.userMs = turn.sentMs;
  if (turn.sentMs < MIN_COMMIT_MS) {
    turn.tooShort = true;
    connection.send({type: 'input_audio_buffer.clear'});
  } else {
    turn.endedAt = performance.now();
    connection.send({type: 'input_audio_buffer.commit'});
    connection.send({type: 'response.create'});
  }
  show('connected', 'Hold the button (or the space bar) while you speak.');
}

async function closeMic() {
  const closing = mic;
  mic = null;
  demo.level = 0;
  if (closing) await closing.close();
}

// ---- connecting -----------------------------------------------------------------------------
function sessionSettings() {
  const session = {type: 'realtime', output_modalities: ['audio'],
                   audio: {input: {turn_detection: demo.mode === 'vad' ? SERVER_VAD : null}}};
  if (inputs.voice.value) session.audio.output = {voice: inputs.voice.value};
  const maxTokens = parseInt(inputs.maxTokens.value, 10);
  if (maxTokens > 0) session.max_output_tokens = maxTokens;
  return session;
}

function setConnected(connected) {
  for (const input of [inputs.key, inputs.mode, inputs.voice, inputs.maxTokens, inputs.connect]) {
    input.disabled = connected;
  }
  inputs.disconnect.disabled = !connected;
  inputs.talk.disabled = !connected;
  inputs.talk.textContent = demo.mode === 'vad' ? 'Start talking' : 'Hold to talk';
}

async function connect() {
  // Both audio contexts start inside this click: browsers let audio start only after a gesture.
  const playerReady = Player.open(onPlayed);
  demo.connects += 1;
  demo.mode = inputs.mode.value;
  show('connecting', 'Connecting…');
  try {
    player = await playerReady;
    const url = realtimeUrl(demo.config.realtime_path, demo.config.model);
    connection = await RealtimeConnection.open(url, inputs.key.value.trim(), onEvent, onClose);
  } catch (error) {
    teardown();
    if (error instanceof Refused) {
      show('refused', `Refused: ${error.message}`);
      return;
    }
    throw error;
  }
  connection.send({type: 'session.update', session: sessionSettings()});
  setConnected(true);
  show('connected', demo.mode === 'vad' ? 'Connected. Press “Start talking”.'
                                        : 'Connected. Hold the button (or the space bar) while you speak.');
}

function teardown() {
  // The session's answers end with it: none is played, cancelled or truncated any more.
  for (const {response} of responses.values()) {
    response.ended = true;
    if (response.status === 'in_progress') response.status = 'disconnected';
  }
  responses.clear();
  for (const turn of demo.turns) turn.speaking = false;
  demo.micOn = false;
  demo.holding = false;
  if (connection) connection.close();
  connection = null;
  closeMic();
  if (player) player.close();
  player = null;
  setConnected(false);
}

function disconnect() {
  teardown();
  show('closed', 'Disconnected.');
}

// ---- wiring ---------------------------------------------------------------------------------
function guarded(handler) {
  return (...args) => Promise.resolve().then(() => handler(...args)).catch(fail);
}

form.addEventListener('submit', (event) => {
  event.preventDefault();
  guarded(connect)();
});
inputs.disconnect.addEventListener('click', disconnect);
inputs.talk.addEventListener('click', guarded(() => (demo.mode === 'vad' ? toggleMic() : null)));
inputs.talk.addEventListener('pointerdown', guarded((event) => {
  if (demo.mode !== 'hold') return null;
  // Captured, the hold lasts until the pointer is lifted even if the button moves from under it:
  // a new turn scrolls the page, and a pointerleave would otherwise end the turn being spoken.
  inputs.talk.setPointerCapture(event.pointerId);
  return press();
}));
for (const kind of ['pointerup', 'pointercancel', 'pointerleave']) {
  inputs.talk.addEventListener(kind, guarded(() => (demo.mode === 'hold' ? release() : null)));
}
inputs.talk.addEventListener('keydown', guarded((event) => {
  if (demo.mode === 'hold' && event.key === ' ' && !event.repeat) return press();
  return null;
}));
inputs.talk.addEventListener('keyup', guarded((event) => {
  if (demo.mode === 'hold' && event.key === ' ') release();
}));
inputs.mode.addEventListener('change', () => {
  inputs.talk.textContent = inputs.mode.value === 'vad' ? 'Start talking' : 'Hold to talk';
});

async function loadConfig() {
  const response = await fetch('config.json', {cache: 'no-store'});
  if (!response.ok) throw new Error(`config.json: HTTP ${response.status}`);
  demo.config = await response.json();
  document.getElementById('model').textContent = demo.config.model;
  inputs.keyLabel.hidden = !demo.config.api_key_required;
  inputs.voice.replaceChildren(new Option('the server’s default', ''),
                               ...demo.config.voices.map((voice) => new Option(voice, voice)));
  setConnected(false);
  show('ready', demo.config.ready
    ? `Ready${demo.config.api_key_required ? ': enter the API key and' : ':'} press Connect.`
    : 'The server is still starting its stages; reload in a moment.');
}

guarded(loadConfig)();
