// What the page shows, drawn from the page's state (app.js) at most once a frame. Text from the
// server goes in as text (textContent), never as HTML.
import {PCM_RATE} from './audio.js';

const seconds = (samples) => `${(samples / PCM_RATE).toFixed(1)} s`;

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function userLine(turn) {
  if (turn.speaking) return 'speaking…';
  if (turn.tooShort) return 'too short to send (hold the button while you speak)';
  return turn.userMs !== null ? `${(turn.userMs / 1000).toFixed(1)} s of speech` : 'speech';
}

function statsLine(response) {
  const parts = [];
  parts.push(response.ttfaMs === null ? 'TTFA …' : `TTFA ${Math.round(response.ttfaMs)} ms`);
  parts.push(`audio ${seconds(response.received)} received, ${seconds(response.played)} played`);
  if (response.interrupted) {
    parts.push(`interrupted: ${response.interrupted === 'speech' ? 'you spoke' : 'you pressed'}`);
  }
  if (response.status !== 'in_progress') {
    const reason = response.reason ? ` (${response.reason})` : '';
    parts.push(`answer ${response.status}${reason}`);
  }
  if (response.truncatedMs !== null) parts.push(`kept as heard: ${response.truncatedMs} ms`);
  return parts.join(' · ');
}

export class View {
  constructor() {
    const byId = (id) => document.getElementById(id);
    this.status = byId('status');
    this.talk = byId('talk');
    this.level = byId('level');
    this.turns = byId('turns');
    this.summary = byId('summary');
    this.logList = byId('log');
    this.turnNodes = new Map();
    this.pending = false;
  }

  schedule(demo) {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.render(demo);
    });
  }

  render(demo) {
    this.status.textContent = demo.message;
    this.status.dataset.status = demo.status;
    this.level.value = demo.level;
    for (const turn of demo.turns) this.renderTurn(turn);
    const ttfas = demo.turns.map((t) => t.response && t.response.ttfaMs).filter((v) => v !== null && v !== undefined);
    this.summary.textContent = ttfas.length
      ? `TTFA per turn (turn end → first audio received): ${ttfas.map((v) => `${Math.round(v)} ms`).join(', ')}`
      : '';
  }

  renderTurn(turn) {
    let nodes = this.turnNodes.get(turn.n);
    if (!nodes) {
      const article = element('article', 'turn');
      const you = element('p', 'you');
      you.append(element('b', '', 'You '), element('span'));
      const answer = element('p', 'assistant');
      answer.append(element('b', '', 'Assistant '), element('span'));
      nodes = {article, you: you.lastChild, answerLine: answer, answer: answer.lastChild,
               stats: element('p', 'stats')};
      article.append(you, answer, nodes.stats);
      this.turns.append(article);
      this.turnNodes.set(turn.n, nodes);
      article.scrollIntoView({block: 'end'});
    }
    nodes.you.textContent = userLine(turn);
    const response = turn.response;
    nodes.answerLine.hidden = !response;
    nodes.answer.textContent = response ? response.text || '…' : '';
    nodes.stats.textContent = response ? statsLine(response) : '';
    nodes.article.classList.toggle('interrupted', Boolean(response && response.interrupted));
  }

  log(line) {
    const item = element('li', '', `${new Date().toLocaleTimeString()} ${line}`);
    this.logList.prepend(item);
    while (this.logList.childElementCount > 50) this.logList.lastChild.remove();
  }
}
