// Audio in and out with the Web Audio API alone: the microphone as pcm16 chunks at 24 kHz, and a
// player that plays the answer's pcm16 as it streams and counts what it has played.
export const PCM_RATE = 24000; // the Realtime API's audio/pcm rate, both ways

function need(condition, message) {
  if (!condition) throw new Error(message);
}

export class Microphone {
  // Call from a user gesture (a click, a key press): the AudioContext is created before the
  // first await, so the browser lets it start. `onChunk(Int16Array)`: 40 ms of pcm16 at 24 kHz.
  static async open(onChunk) {
    need(window.isSecureContext && navigator.mediaDevices && navigator.mediaDevices.getUserMedia,
         'this page cannot use a microphone: browsers allow it only on https:// pages and on ' +
         'http://localhost or http://127.0.0.1 (an SSH tunnel to the server works)');
    const context = new AudioContext();
    try {
      const stream = await navigator.mediaDevices.getUserMedia({audio: {
        channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true}});
      await context.audioWorklet.addModule(new URL('./capture-worklet.js', import.meta.url));
      const node = new AudioWorkletNode(context, 'omni-pd-capture', {
        numberOfInputs: 1, numberOfOutputs: 0, channelCount: 1, channelCountMode: 'explicit'});
      node.port.onmessage = (event) => onChunk(event.data);
      let head = context.createMediaStreamSource(stream);
      if (context.sampleRate > PCM_RATE) { // below 12 kHz before the worklet drops to 24 kHz
        const lowpass = new BiquadFilterNode(context, {type: 'lowpass', frequency: 11000});
        head.connect(lowpass);
        head = lowpass;
      }
      head.connect(node);
      await context.resume();
      return new Microphone(context, stream, node);
    } catch (error) {
      context.close();
      throw error;
    }
  }

  constructor(context, stream, node) {
    this.context = context;
    this.stream = stream;
    this.node = node;
  }

  close() {
    this.node.port.onmessage = null;
    for (const track of this.stream.getTracks()) track.stop();
    return this.context.close();
  }
}

export class Player {
  // Call from a user gesture, as Microphone.open. `onPlayed({counts, busy, cleared})`: samples
  // played per response id (player-worklet.js).
  static async open(onPlayed) {
    const context = new AudioContext({sampleRate: PCM_RATE});
    try {
      await context.audioWorklet.addModule(new URL('./player-worklet.js', import.meta.url));
      const node = new AudioWorkletNode(context, 'omni-pd-player', {
        numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1]});
      node.port.onmessage = (event) => onPlayed(event.data);
      node.connect(context.destination);
      await context.resume();
      return new Player(context, node);
    } catch (error) {
      context.close();
      throw error;
    }
  }

  constructor(context, node) {
    this.context = context;
    this.node = node;
  }

  play(id, samples) {
    this.node.port.postMessage({type: 'chunk', id, samples}, [samples.buffer]);
  }

  clear() { // stops at once; the worklet answers with a report whose `cleared` is true
    this.node.port.postMessage({type: 'clear'});
  }

  close() {
    this.node.port.onmessage = null;
    return this.context.close();
  }
}

// pcm16 is little-endian whatever the machine: bytes are spelled out, not viewed.
export function pcm16ToBase64(samples) {
  let bytes = '';
  for (const v of samples) bytes += String.fromCharCode(v & 0xff, (v >> 8) & 0xff);
  return btoa(bytes);
}

export function base64ToFloat32(data) {
  const bytes = atob(data);
  const out = new Float32Array(bytes.length >> 1);
  for (let i = 0; i < out.length; i++) {
    const v = bytes.charCodeAt(2 * i) | (bytes.charCodeAt(2 * i + 1) << 8);
    out[i] = (v >= 0x8000 ? v - 0x10000 : v) / 32768;
  }
  return out;
}

export function rms(samples) {
  let sum = 0;
  for (const v of samples) sum += v * v;
  return samples.length ? Math.sqrt(sum / samples.length) / 32768 : 0;
}
