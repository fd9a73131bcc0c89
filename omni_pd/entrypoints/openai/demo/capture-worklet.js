// The microphone, as the Realtime API takes it: mono pcm16 at 24 kHz, posted to the page in
// chunks of CHUNK samples (Int16Array, transferred). The AudioContext runs at the device's rate
// (44.1 or 48 kHz, usually); this resamples by linear interpolation, after the low-pass filter
// that the page puts in front of it.
const OUT_RATE = 24000;
const CHUNK = 960; // 40 ms

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / OUT_RATE; // input samples per output sample
    this.pos = 0; // the next output sample's position, in input samples from this block's start
    this.prev = 0; // the last input sample of the previous block (position -1)
    this.chunk = new Int16Array(CHUNK);
    this.filled = 0;
  }

  push(value) {
    const clipped = Math.max(-1, Math.min(1, value));
    this.chunk[this.filled++] = Math.round(clipped < 0 ? clipped * 32768 : clipped * 32767);
    if (this.filled === CHUNK) {
      this.port.postMessage(this.chunk, [this.chunk.buffer]);
      this.chunk = new Int16Array(CHUNK);
      this.filled = 0;
    }
  }

  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (!input || input.length === 0) return true;
    const n = input.length;
    let p = this.pos;
    while (p < n - 1) {
      const i = Math.floor(p);
      const a = i < 0 ? this.prev : input[i];
      this.push(a + (input[i + 1] - a) * (p - i));
      p += this.step;
    }
    this.pos = p - n;
    this.prev = input[n - 1];
    return true;
  }
}

registerProcessor('omni-pd-capture', Capture);
